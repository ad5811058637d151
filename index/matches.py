"""Alignments as results: which image region each sentence fragment matched, with its triplet and box, and
whether what it names is in the picture (phrase evidence, model/evidence.py); where the model has a grounder
(model/grounder.py), the region drawn for a fragment that names a thing is where the grounder puts the thing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fragsearch.index.types import FragmentMatch
from fragsearch.model.bundle import Bundle
from fragsearch.model.evidence import Found, SentenceEvidence
from fragsearch.model.grounder import SentenceGrounding
from fragsearch.model.score import align
from fragsearch.model.text import Triplet


def matches(img: np.ndarray, sent: np.ndarray, triplets: Sequence[Triplet] | None,
            boxes: np.ndarray, blocks: int = 1, labels: Sequence[str | None] = (),
            found: Found | None = None, regions: Sequence[tuple[int, list[float]] | None] | None = None
            ) -> list[FragmentMatch]:
    """The alignment of one image-sentence pair as results, in sentence-fragment order.

    img: (F, h) image fragments with boxes (F, 4) and their detector labels (empty: none known); sent: (T, h)
    sentence fragments with their triplets. Sentence fragments without a positive match (no share in S_kl) are
    left out, unless they name a thing the phrase evidence `found` (the sentence's, in this image) reads: a
    thing the picture lacks is reported (not found), not dropped. `blocks`: the model's (``Bundle.blocks``; a
    merged model aligns by the thresholded pair score, model/score.py). `regions`: per sentence fragment, the region
    that holds the thing it names and the box drawn for it (the grounder's places, `SentenceGrounding.places_of` and
    `of_triplets`; None: the aligned region and its box). The score stays the fragment's share of S_kl (its best
    region's score): how well it matches, where the region says where the thing it names is.
    """
    al = align(img, sent, blocks)
    out = []
    for j, (i, score, ok) in enumerate(zip(al.image_fragment, al.score, al.matched, strict=True)):
        f = None if found is None else found.fragments[j]
        if not ok and f is None:
            continue
        drawn = None if regions is None else regions[j]
        box = [float(v) for v in boxes[i]]
        if drawn is not None:
            i, box = drawn
        t = triplets[j] if triplets else Triplet("", f"fragment {j}", f"fragment {j}")
        out.append(FragmentMatch(triplet=t.text() if triplets else f"fragment {j}", relation=t.rel,
                                 words=(t.w1, t.w2), box=box, fragment=int(i),
                                 score=float(score), label=label_at(labels, int(i)), found=f))
    return out


@dataclass(frozen=True)
class SentenceReading:
    """What is read of a query sentence once for every image it is aligned with: its phrase evidence and its
    grounding (each None where the model has none)."""

    evidence: SentenceEvidence | None = None
    grounding: SentenceGrounding | None = None


def read_sentence(bundle: Bundle, sent: np.ndarray, triplets: Sequence[Triplet] | None) -> SentenceReading:
    """A sentence's phrase evidence and grounding, read once per query (each None: the model has none, or the
    fragments have no triplets)."""
    if not triplets or len(triplets) != len(sent):
        return SentenceReading()
    sent = np.asarray(sent, dtype=np.float32)
    scale, grounder = bundle.evidence, bundle.grounder
    return SentenceReading(None if scale is None else scale.for_sentence(sent, list(triplets)),
                           None if grounder is None else grounder.for_sentence(sent, list(triplets), bundle.blocks))


def aligned(img: np.ndarray, sent: np.ndarray, triplets: Sequence[Triplet] | None, boxes: np.ndarray,
            blocks: int, labels: Sequence[str | None], reading: SentenceReading
            ) -> tuple[list[FragmentMatch], Found | None]:
    """One pair's alignment (`matches`, each thing drawn where the grounder puts it) and its phrase evidence
    (None where the model has none)."""
    return aligned_all([img], sent, triplets, [boxes], blocks, [labels], reading)[0]


def aligned_all(imgs: Sequence[np.ndarray], sent: np.ndarray, triplets: Sequence[Triplet] | None,
                boxes: Sequence[np.ndarray], blocks: int, labels: Sequence[Sequence[str | None]],
                reading: SentenceReading) -> list[tuple[list[FragmentMatch], Found | None]]:
    """`aligned` of one sentence with each of several images (a page of results: imgs (F_k, h) with boxes
    (F_k, 4) and labels each): the images of as many fragments are read by the evidence and the grounder in one
    product."""
    found: list[Found | None] = [None] * len(imgs)
    regions: list[list[tuple[int, list[float]] | None] | None] = [None] * len(imgs)
    g = reading.grounding
    by_count: dict[int, list[int]] = {}
    for n, img in enumerate(imgs):
        by_count.setdefault(len(img), []).append(n)
    for group in by_count.values():
        stack = np.stack([np.asarray(imgs[n], np.float32) for n in group])
        if reading.evidence is not None:
            for n, f in zip(group, reading.evidence.found_in(stack), strict=True):
                found[n] = f
        if g is not None:
            drawn = g.places_of(stack, np.stack([np.asarray(boxes[n], np.float32) for n in group]))
            for n, r in zip(group, drawn, strict=True):
                regions[n] = g.of_triplets(r)
    return [(matches(img, sent, triplets, boxes[n], blocks, labels[n], found[n], regions[n]), found[n])
            for n, img in enumerate(imgs)]


def label_at(labels: Sequence[str | None], fragment: int) -> str | None:
    """Fragment `fragment`'s detector label, None where it has none or none are known."""
    return labels[fragment] if fragment < len(labels) else None
