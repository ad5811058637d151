"""Near-duplicates: the same photo resized, re-encoded or cropped a little, found by the cosine of the
images' whole-frame fragment (row 0 of the stored fragments: the model's embedding of the whole-image
CNN feature). A pair is a near-duplicate at cosine >= THRESHOLD, measured by bench/duplicates_bench.py
on altered copies of Flickr8K dev images against distinct photos (docs/results/duplicates-dev.csv).

    python -m fragsearch.index.duplicates artifacts/index/collection-...    # the collection-wide report
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from fragsearch.index.images import ImageIndex

logger = logging.getLogger(__name__)

THRESHOLD = 0.825  # docs/results/duplicates-dev.csv: chosen on the first 80 dev images, reported on the next 80
BLOCK = 2048  # images compared at a time in the collection-wide report


@dataclass(frozen=True)
class Duplicate:
    image_id: int
    name: str
    similarity: float


def duplicates_of(images: ImageIndex, image_id: int, threshold: float = THRESHOLD) -> list[Duplicate] | None:
    """The near-duplicates of an indexed image (itself left out), most alike first; None when unknown."""
    ids, mat = images.vectors.of("whole").matrix(images)
    where = np.searchsorted(ids, image_id)
    if where >= len(ids) or ids[where] != image_id:
        return None
    sims = mat @ mat[where]
    keep = np.flatnonzero((sims >= threshold) & (ids != image_id))
    order = keep[np.lexsort((ids[keep], -sims[keep]))]
    names = {i: rec.name for i in ids[order].tolist() if (rec := images.get(i)) is not None}
    return [Duplicate(int(ids[i]), names[int(ids[i])], float(sims[i])) for i in order if int(ids[i]) in names]


def duplicate_groups(images: ImageIndex, threshold: float = THRESHOLD) -> list[list[int]]:
    """Groups of near-duplicates across the collection (connected by pairs at or above `threshold`),
    largest first, each by id; images without one are not listed."""
    ids, mat = images.vectors.of("whole").matrix(images)
    parent = np.arange(len(ids))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    for start in range(0, len(ids), BLOCK):
        sims = mat[start : start + BLOCK] @ mat.T
        rows, cols = np.nonzero(sims >= threshold)
        for r, c in zip(rows + start, cols, strict=True):
            if r < c:
                a, b = root(int(r)), root(int(c))
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(len(ids)):
        groups.setdefault(root(i), []).append(int(ids[i]))
    return sorted((g for g in groups.values() if len(g) > 1), key=lambda g: (-len(g), g[0]))



if __name__ == "__main__":  # `python -m fragsearch.index.duplicates`, as the docs write it: the command's alias
    from fragsearch.commands.duplicates import main

    raise SystemExit(main())
