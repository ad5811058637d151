"""More like this: images ranked for an image through the sentences that describe it.

An image is described by the `m` sentences of the sentence collection with the best S_kl for it
(what /annotate returns); the fragments of those sentences, together, are then the query of an
ordinary image search, scored by the same S_kl. So an image ranks high when its regions match
what the query image's best descriptions say (their triplets), and every result comes with the
alignment of those triplets to its regions: the reason it is similar, in words. Triplets that
several descriptions share appear once per description and so weigh more: what the descriptions
agree on counts most.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from index.images import ImageIndex
from index.query import embed_encoded, text_lock
from index.sentences import SentenceIndex
from index.types import ImageHit, SentenceHit
from model.text import Triplet

DESCRIPTIONS = 5


@dataclass
class Similar:
    """The sentences that stood for the query image, and the images ranked for them."""

    described_by: list[SentenceHit]
    hits: list[ImageHit]
    offset: int = 0
    considered: int = 0  # images scored exactly (the query's own among them when it is indexed)


def describe_and_search(images: ImageIndex, sentences: SentenceIndex, img: torch.Tensor, boxes: np.ndarray,
                        k: int, descriptions: int = DESCRIPTIONS, exclude: int | None = None,
                        offset: int = 0) -> Similar:
    """The images ranked offset + 1 .. offset + k as most like one given by its embedded fragments
    img (F, h) with boxes (F, 4); `exclude` (the query's own id, when it is indexed) is left out."""
    described = sentences.annotate_vectors(img, boxes, descriptions)
    if not described:
        return Similar([], [])
    bundle = images.bundle
    with text_lock(bundle):
        enc = bundle.text.encode([h.text for h in described])
    parts = [(s, t) for s, t in embed_encoded(bundle, enc) if len(s)]
    if not parts:
        return Similar(described, [])
    sent = torch.cat([s for s, _ in parts])
    triplets: list[Triplet] = [t for _, ts in parts for t in ts]
    page = images.search_page(sent, triplets, 0, offset + k + (exclude is not None))
    hits = [h for h in page.hits if h.image_id != exclude]
    return Similar(described, hits[offset : offset + k], offset, page.considered)
