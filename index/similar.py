"""More like this: images ranked for an image by the cosine of their mean embedded fragments, and
explained through the sentences that describe the query.

The ranking is one matrix-vector product: each image is stood for by the mean of its embedded
fragments (the shared space of sentences and regions), kept by the index and extended as images are
added (`ImageIndex.vectors`: index/image_vectors.py). On the more-like-this proxy of
bench/similar_bench.py it is as good as ranking through the query's descriptions by S_kl
(docs/results/similar-dev.csv), at a fraction of the cost.

The explanation: the query is described by the `m` sentences of the sentence collection with the
best S_kl for it (what /annotate returns), and each result shown gets the alignment of those
sentences' triplets to its regions: which of the words that describe the query it matches, and
where. Only the results shown are aligned; the sentences never change the ranking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from fragsearch.index.images import ImageIndex
from fragsearch.index.matches import SentenceReading, aligned_all, read_sentence
from fragsearch.index.sentences import SentenceIndex
from fragsearch.index.types import ImageHit, ImageRecord, Page, SentenceHit
from fragsearch.model.embed import EmbeddedImage, embed_image, embed_texts
from fragsearch.model.imageio import Photo
from fragsearch.model.text import Triplet

DESCRIPTIONS = 5


@dataclass
class Similar:
    """The sentences that stood for the query image, and the images ranked for it."""

    described_by: list[SentenceHit]
    hits: list[ImageHit]
    offset: int = 0
    considered: int = 0  # images ranked (the query's own left out when it is indexed)
    # the best scores of the sentences ranked for the query image: what a description's relevance reads
    described_best: np.ndarray = field(default_factory=lambda: np.zeros(0))
    described_collection: int = 0  # the sentences of the collection they were ranked in


def unit_mean(img: np.ndarray) -> np.ndarray:
    """The unit-length mean of embedded fragments (F, h) -> (h,)."""
    v = np.asarray(img, dtype=np.float32).mean(0, dtype=np.float32)
    return np.asarray(v / max(float(np.linalg.norm(v)), 1e-12), dtype=np.float32)


def rank_like(images: ImageIndex, img: np.ndarray, exclude: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every live image but `exclude` ranked by the cosine of its mean embedded fragment with the
    query's (img (F, h)): (ids, cosines), best first, ties to the smaller id."""
    ids, mat = images.vectors.of("mean").matrix(images)
    sims = mat @ unit_mean(img)
    keep = ids != exclude if exclude is not None else np.ones(len(ids), dtype=bool)
    ids, sims = ids[keep], sims[keep]
    order = np.lexsort((ids, -sims))
    return ids[order], sims[order]


def describe(sentences: SentenceIndex, images: ImageIndex, img: np.ndarray, boxes: np.ndarray,
             descriptions: int) -> tuple[Page[SentenceHit], np.ndarray | None, list[Triplet]]:
    """The query's best `descriptions` sentences, and their fragments (T, h) with triplets, together."""
    page = sentences.annotate(EmbeddedImage(img, boxes, 0, 0), descriptions)  # no size needed to rank
    if not page.hits:
        return page, None, []
    parts = [(s, t) for s, t in embed_texts(images.bundle, [h.text for h in page.hits]) if len(s)]
    if not parts:
        return page, None, []
    return page, np.concatenate([s for s, _ in parts]), [t for _, ts in parts for t in ts]


def more_like_this(images: ImageIndex, sentences: SentenceIndex | None, img: np.ndarray, boxes: np.ndarray,
                   k: int, descriptions: int = DESCRIPTIONS, exclude: int | None = None, offset: int = 0) -> Similar:
    """The images ranked offset + 1 .. offset + k as most like one given by its embedded fragments
    img (F, h) with boxes (F, 4), each aligned to the query's descriptions (none without a sentence
    collection); `exclude` (the query's own id, when it is indexed) is left out."""
    ids, sims = rank_like(images, img, exclude)
    described, sent, triplets = (describe(sentences, images, img, boxes, descriptions) if sentences is not None
                                 else (Page([], 0, 0), None, []))
    reading = SentenceReading() if sent is None else read_sentence(images.bundle, sent, triplets)
    shown: list[tuple[int, float, ImageRecord, np.ndarray, np.ndarray]] = []
    for image_id, cosine in zip(ids[offset : offset + k].tolist(), sims[offset : offset + k].tolist(), strict=True):
        rec, stored = images.get(image_id), images.fragments(image_id)
        if rec is None or stored is None:  # removed meanwhile
            continue
        shown.append((image_id, float(cosine), rec, *stored))
    read = (aligned_all([frags for *_, frags, _ in shown], sent, triplets, [b for *_, b in shown],
                        images.bundle.blocks, [rec.labels for _, _, rec, _, _ in shown], reading)
            if sent is not None else [([], None) for _ in shown])
    hits = [ImageHit(image_id, rec.name, rec.path, rec.width, rec.height, cosine, alignment, file=rec.file,
                     found=found)
            for (image_id, cosine, rec, _, _), (alignment, found) in zip(shown, read, strict=True)]
    return Similar(described.hits, hits, offset, len(ids), described.best, described.collection)


def similar_to_indexed(images: ImageIndex, sentences: SentenceIndex | None, image_id: int, k: int,
                       offset: int = 0) -> tuple[ImageRecord, Similar] | None:
    """An indexed image's record and the images like it (itself left out), or None when there is no
    such image."""
    rec, found = images.get(image_id), images.fragments(image_id)
    if rec is None or found is None:
        return None
    return rec, more_like_this(images, sentences, *found, k=k, exclude=image_id, offset=offset)


def similar_to_image(images: ImageIndex, sentences: SentenceIndex | None, image: Image.Image | Photo, k: int,
                     offset: int = 0) -> Similar:
    """The images like an image that is not indexed (an upload); the descriptions' alignments are in
    its pixels."""
    e = embed_image(images.bundle, image)
    return more_like_this(images, sentences, e.vectors, e.boxes, k=k, offset=offset)
