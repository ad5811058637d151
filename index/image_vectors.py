"""One unit vector per live image of an index, made from its stored embedded fragments and kept by the
index as images come and go (`ImageIndex.vectors`): the mean embedded fragment ("mean", more like this:
index/similar.py) and the whole-frame fragment ("whole", near-duplicates: index/duplicates.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from fragsearch.index.base import FragmentIndex

CHUNK = 2048  # images whose fragments are read at a time when their vectors are computed


class ImageVectors:
    """One unit vector per live image of an index, made from its stored embedded fragments by
    `reduce` ((C, F, h) fragments, (C, F) mask -> (C, h)) once per image, kept as images come and go."""

    def __init__(self, reduce: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        self._reduce = reduce
        self._vecs: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def matrix(self, images: FragmentIndex[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(ids (N,), unit means (N, h)) of the index's live images, by id."""
        with self._lock, images.reading():
            ids = np.sort(np.asarray(images.ids(), dtype=np.int64))
            missing = ids[[int(i) not in self._vecs for i in ids]] if len(ids) else ids
            for start in range(0, len(missing), CHUNK):
                part = missing[start : start + CHUNK]
                vec = self._reduce(*images.stored.vectors(part))
                unit = vec / np.maximum(np.linalg.norm(vec, axis=1, keepdims=True), 1e-12)
                self._vecs.update(zip(part.tolist(), unit.astype(np.float32), strict=True))
            live = set(ids.tolist())
            for gone in [i for i in self._vecs if i not in live]:  # removed images
                del self._vecs[gone]
            mat = np.stack([self._vecs[int(i)] for i in ids]) if len(ids) else np.zeros((0, images.bundle.dim),
                                                                                          np.float32)
        return ids, mat


def masked_mean(vecs: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return (vecs * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1)


def whole_image(vecs: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return vecs[:, 0]  # row 0: the whole frame


REDUCERS = {"mean": masked_mean, "whole": whole_image}


class KeptVectors:
    """The vectors an index keeps, one `ImageVectors` per kind (made at first use)."""

    def __init__(self) -> None:
        self._kinds: dict[str, ImageVectors] = {}
        self._lock = threading.Lock()

    def of(self, kind: str) -> ImageVectors:
        """The kept vectors of one kind: "mean" (mean embedded fragment) or "whole" (the whole-frame fragment)."""
        with self._lock:
            if kind not in self._kinds:
                self._kinds[kind] = ImageVectors(REDUCERS[kind])
            return self._kinds[kind]
