"""More like this: images ranked for an image by the cosine of their mean embedded fragments, and
explained through the sentences that describe the query.

The ranking is one matrix-vector product: each image is stood for by the mean of its embedded
fragments (the shared space of sentences and regions), kept per index and extended as images are
added (`ImageVectors`). On the more-like-this proxy of bench/similar_bench.py it is as good as ranking
through the query's descriptions by S_kl (docs/results/similar-dev.csv), at a fraction of the cost.

The explanation: the query is described by the `m` sentences of the sentence collection with the
best S_kl for it (what /annotate returns), and each result shown gets the alignment of those
sentences' triplets to its regions: which of the words that describe the query it matches, and
where. Only the results shown are aligned; the sentences never change the ranking.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from index.images import ImageIndex
from index.matches import matches
from index.sentences import SentenceIndex
from index.types import ImageHit, ImageRecord, SentenceHit
from model.embed import embed_image, embed_texts
from model.text import Triplet

DESCRIPTIONS = 5
CHUNK = 2048  # images whose fragments are read at a time when their means are computed


@dataclass
class Similar:
    """The sentences that stood for the query image, and the images ranked for it."""

    described_by: list[SentenceHit]
    hits: list[ImageHit]
    offset: int = 0
    considered: int = 0  # images ranked (the query's own left out when it is indexed)


def unit_mean(img: torch.Tensor) -> np.ndarray:
    """The unit-length mean of embedded fragments (F, h) -> (h,)."""
    v = torch.as_tensor(img, dtype=torch.float32).mean(0).numpy().astype(np.float32)
    return np.asarray(v / max(float(np.linalg.norm(v)), 1e-12), dtype=np.float32)


class ImageVectors:
    """One unit vector per live image of an index, made from its stored embedded fragments by
    `reduce` ((C, F, h) fragments, (C, F) mask -> (C, h)) once per image, kept as images come and go."""

    def __init__(self, reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self._reduce = reduce
        self._vecs: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def matrix(self, images: ImageIndex) -> tuple[np.ndarray, np.ndarray]:
        """(ids (N,), unit means (N, h)) of the index's live images, by id."""
        with self._lock, images.reading():
            ids = np.sort(np.asarray(images.ids(), dtype=np.int64))
            missing = ids[[int(i) not in self._vecs for i in ids]] if len(ids) else ids
            for start in range(0, len(missing), CHUNK):
                part = missing[start : start + CHUNK]
                vec = self._reduce(*images.stored.vectors(part))
                unit = vec / vec.norm(dim=1, keepdim=True).clamp_min(1e-12)
                self._vecs.update(zip(part.tolist(), unit.numpy().astype(np.float32), strict=True))
            live = set(ids.tolist())
            for gone in [i for i in self._vecs if i not in live]:  # removed images
                del self._vecs[gone]
            mat = np.stack([self._vecs[int(i)] for i in ids]) if len(ids) else np.zeros((0, images.bundle.dim),
                                                                                          np.float32)
        return ids, mat


def masked_mean(vecs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (vecs * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)


def whole_image(vecs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return vecs[:, 0]  # row 0: the whole frame


_kept: dict[str, weakref.WeakKeyDictionary[ImageIndex, ImageVectors]] = {
    "mean": weakref.WeakKeyDictionary(), "whole": weakref.WeakKeyDictionary()}
_kept_lock = threading.Lock()
REDUCERS = {"mean": masked_mean, "whole": whole_image}


def image_vectors(images: ImageIndex, kind: str) -> ImageVectors:
    """The kept vectors of an index: "mean" (mean embedded fragment) or "whole" (the whole-frame fragment)."""
    with _kept_lock:
        kept = _kept[kind]
        if images not in kept:
            kept[images] = ImageVectors(REDUCERS[kind])
        return kept[images]


def rank_like(images: ImageIndex, img: torch.Tensor, exclude: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every live image but `exclude` ranked by the cosine of its mean embedded fragment with the
    query's (img (F, h)): (ids, cosines), best first, ties to the smaller id."""
    ids, mat = image_vectors(images, "mean").matrix(images)
    sims = mat @ unit_mean(img)
    keep = ids != exclude if exclude is not None else np.ones(len(ids), dtype=bool)
    ids, sims = ids[keep], sims[keep]
    order = np.lexsort((ids, -sims))
    return ids[order], sims[order]


def describe(sentences: SentenceIndex, images: ImageIndex, img: torch.Tensor, boxes: np.ndarray,
             descriptions: int) -> tuple[list[SentenceHit], torch.Tensor | None, list[Triplet]]:
    """The query's best `descriptions` sentences, and their fragments (T, h) with triplets, together."""
    described = sentences.annotate_vectors(img, boxes, descriptions)
    if not described:
        return [], None, []
    parts = [(s, t) for s, t in embed_texts(images.bundle, [h.text for h in described]) if len(s)]
    if not parts:
        return described, None, []
    return described, torch.cat([s for s, _ in parts]), [t for _, ts in parts for t in ts]


@torch.inference_mode()
def more_like_this(images: ImageIndex, sentences: SentenceIndex | None, img: torch.Tensor, boxes: np.ndarray,
                   k: int, descriptions: int = DESCRIPTIONS, exclude: int | None = None, offset: int = 0) -> Similar:
    """The images ranked offset + 1 .. offset + k as most like one given by its embedded fragments
    img (F, h) with boxes (F, 4), each aligned to the query's descriptions (none without a sentence
    collection); `exclude` (the query's own id, when it is indexed) is left out."""
    ids, sims = rank_like(images, img, exclude)
    described, sent, triplets = (describe(sentences, images, img, boxes, descriptions) if sentences is not None
                                 else ([], None, []))
    hits: list[ImageHit] = []
    for image_id, cosine in zip(ids[offset : offset + k].tolist(), sims[offset : offset + k].tolist(), strict=True):
        rec, found = images.get(image_id), images.fragments(image_id)
        if rec is None or found is None:  # removed meanwhile
            continue
        frags, frag_boxes = found
        alignment = matches(frags, sent, triplets, frag_boxes, images.bundle.blocks) if sent is not None else []
        hits.append(ImageHit(image_id, rec.name, rec.path, rec.width, rec.height, float(cosine), alignment))
    return Similar(described, hits, offset, len(ids))


def similar_to_indexed(images: ImageIndex, sentences: SentenceIndex | None, image_id: int, k: int,
                       offset: int = 0) -> tuple[ImageRecord, Similar] | None:
    """An indexed image's record and the images like it (itself left out), or None when there is no
    such image."""
    rec, found = images.get(image_id), images.fragments(image_id)
    if rec is None or found is None:
        return None
    return rec, more_like_this(images, sentences, *found, k=k, exclude=image_id, offset=offset)


def similar_to_image(images: ImageIndex, sentences: SentenceIndex | None, image: Image.Image, k: int,
                     offset: int = 0) -> Similar:
    """The images like an image that is not indexed (an upload); the descriptions' alignments are in
    its pixels."""
    e = embed_image(images.bundle, image)
    return more_like_this(images, sentences, e.vectors, e.boxes, k=k, offset=offset)
