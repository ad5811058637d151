"""Phrase–box supervision for the fragment objective (TrainConfig.box_supervision): where Flickr30k Entities
says which box a phrase of a training caption names (model/entities.py), the triplets that name the phrase's
head noun are told which of their image's fragments hold it.

A triplet of a training sentence (w1, w2) is tied to the boxed phrases of its caption whose head noun (last
word) is one of its two words: ``nsubj(runs, dog)`` and ``det(dog, a)`` to "a dog", ``prep_in(dog, grass)`` to
"a dog" and to "the grass". Its labels over its own image's fragments are +1 for a fragment that holds one of
those phrases' boxes (IoU >= ``BOX_IOU``), -1 for the image's other fragments; they replace the multiple-instance
labels of that triplet's bag (training/objectives.py ``fragment_loss``). A triplet tied to no boxed phrase, a
phrase whose boxes no fragment holds, the whole-sentence fragment and a caption with no Entities line keep the
MIL labels (0 here). The whole image is a fragment like any other: +1 only where it holds the box (a scene).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from fragsearch.model.boxes import box_iou
from fragsearch.model.entities import ImageEntities
from fragsearch.model.text import Triplet

logger = logging.getLogger(__name__)

BOX_IOU = 0.5  # a fragment holds a phrase's box at this IoU with one of its boxes (the grounding measure's)
WHOLE = "<sentence>"  # the whole-sentence fragment's relation (model.fragments.SENTENCE_REL): never tied


def triplet_labels(triplets: Sequence[Triplet], caption: str, entities: ImageEntities | None,
                   boxes: np.ndarray) -> np.ndarray | None:
    """(T, F) int8 labels of one sentence's triplets against its image's fragments `boxes` (F, 4) in the pixels
    of the copy (row 0 the whole image, which gives the copy's size); None when nothing is labelled."""
    if entities is None:
        return None
    matched = entities.match(caption)
    if matched is None:
        return None
    phrases = entities.boxed(matched)
    if not phrases:
        return None
    width, height = float(boxes[0, 2]), float(boxes[0, 3])
    holds = {p.chain: box_iou(boxes, entities.boxes_at(p.chain, round(width), round(height))).max(axis=1) >= BOX_IOU
             for p in phrases}
    labels = np.zeros((len(triplets), len(boxes)), np.int8)
    for t, trip in enumerate(triplets):
        if trip.rel == WHOLE:
            continue
        tied = [holds[p.chain] for p in phrases if p.head in (trip.w1, trip.w2)]
        if not tied:
            continue
        positive = np.logical_or.reduce(tied)
        if positive.any():
            labels[t] = np.where(positive, 1, -1)
    return labels if labels.any() else None


def sentence_labels(triplets: Sequence[Sequence[Triplet]], sentences: Sequence[str], pair_image: np.ndarray,
                    names: Sequence[str], boxes: np.ndarray, entities: Mapping[str, ImageEntities]
                    ) -> list[np.ndarray | None]:
    """`triplet_labels` of every training sentence (its image: `pair_image`; the images' fragments `boxes`
    (N, F, 4)), with a log line of how many sentences and triplets are labelled."""
    out = [triplet_labels(trips, text, entities.get(names[int(k)]), boxes[int(k)])
           for trips, text, k in zip(triplets, sentences, pair_image, strict=True)]
    labelled = [x for x in out if x is not None]
    logger.info("box supervision: %d of %d sentences, %d of %d triplets labelled", len(labelled), len(out),
                sum(int(x.any(axis=1).sum()) for x in labelled), sum(len(t) for t in triplets))
    return out


def batch_labels(labels: Sequence[np.ndarray | None], idx: np.ndarray, local: np.ndarray, n_images: int,
                 n_fragments: int, n_rows: int, skip: np.ndarray | None = None) -> np.ndarray | None:
    """The labels of a batch as a (n_images * n_fragments, len(idx) * n_rows) int8 matrix over its padded image
    and sentence fragments (image k's fragment f is row k * n_fragments + f; sentence p's row t is column
    p * n_rows + t): each sentence's labels at its own image's rows, 0 elsewhere; None when the batch has none.
    `skip` (len(idx),) bool: sentences drawn in another form than the one labelled (their rows differ)."""
    out: np.ndarray | None = None
    for p, sentence in enumerate(idx):
        lab = labels[int(sentence)]
        if lab is None or (skip is not None and skip[p]):
            continue
        if out is None:
            out = np.zeros((n_images * n_fragments, len(idx) * n_rows), np.int8)
        k = int(local[p])
        t = min(len(lab), n_rows)
        out[k * n_fragments : (k + 1) * n_fragments, p * n_rows : p * n_rows + t] = lab[:t].T
    return out
