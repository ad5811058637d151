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
from PIL import Image

from index.images import ImageIndex
from index.sentences import SentenceIndex
from index.types import ImageHit, ImageRecord, SentenceHit
from model.embed import embed_image, embed_texts
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
    parts = [(s, t) for s, t in embed_texts(images.bundle, [h.text for h in described]) if len(s)]
    if not parts:
        return Similar(described, [])
    sent = torch.cat([s for s, _ in parts])
    triplets: list[Triplet] = [t for _, ts in parts for t in ts]
    page = images.search_vectors_page(sent, triplets, 0, offset + k + (exclude is not None))
    hits = [h for h in page.hits if h.image_id != exclude]
    return Similar(described, hits[offset : offset + k], offset, page.considered)


def similar_to_indexed(images: ImageIndex, sentences: SentenceIndex, image_id: int, k: int,
                       offset: int = 0) -> tuple[ImageRecord, Similar] | None:
    """An indexed image's record and the images like it (itself left out), or None when there is no
    such image."""
    rec, found = images.get(image_id), images.fragments(image_id)
    if rec is None or found is None:
        return None
    return rec, describe_and_search(images, sentences, *found, k=k, exclude=image_id, offset=offset)


def similar_to_image(images: ImageIndex, sentences: SentenceIndex, image: Image.Image, k: int,
                     offset: int = 0) -> Similar:
    """The images like an image that is not indexed (an upload); the descriptions' alignments are in
    its pixels."""
    e = embed_image(images.bundle, image)
    return describe_and_search(images, sentences, e.vectors, e.boxes, k=k, offset=offset)
