"""Alignments as results: which image region each sentence fragment matched, with its triplet and box, and
whether what it names is in the picture (phrase evidence, model/evidence.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from index.types import FragmentMatch
from model.bundle import Bundle
from model.evidence import Found, SentenceEvidence
from model.score import align
from model.text import Triplet


def matches(img: np.ndarray, sent: np.ndarray, triplets: Sequence[Triplet] | None,
            boxes: np.ndarray, blocks: int = 1, labels: Sequence[str | None] = (),
            found: Found | None = None) -> list[FragmentMatch]:
    """The alignment of one image-sentence pair as results, in sentence-fragment order.

    img: (F, h) image fragments with boxes (F, 4) and their detector labels (empty: none known); sent: (T, h)
    sentence fragments with their triplets. Sentence fragments without a positive match (no share in S_kl) are
    left out, unless they name a thing the phrase evidence `found` (the sentence's, in this image) reads: a
    thing the picture lacks is reported (not found), not dropped. `blocks`: the model's (``Bundle.blocks``; a
    merged model aligns by the thresholded pair score, model/score.py).
    """
    al = align(img, sent, blocks)
    out = []
    for j, (i, score, ok) in enumerate(zip(al.image_fragment, al.score, al.matched, strict=True)):
        f = None if found is None else found.fragments[j]
        if not ok and f is None:
            continue
        t = triplets[j] if triplets else Triplet("", f"fragment {j}", f"fragment {j}")
        out.append(FragmentMatch(triplet=t.text() if triplets else f"fragment {j}", relation=t.rel,
                                 words=(t.w1, t.w2), box=[float(v) for v in boxes[i]], fragment=int(i),
                                 score=float(score), label=label_at(labels, int(i)), found=f))
    return out


def sentence_evidence(bundle: Bundle, sent: np.ndarray, triplets: Sequence[Triplet] | None
                      ) -> SentenceEvidence | None:
    """A sentence's phrase evidence, read once per query (None: the model has none, or the fragments have no
    triplets)."""
    scale = bundle.evidence
    if scale is None or not triplets or len(triplets) != len(sent):
        return None
    return scale.for_sentence(np.asarray(sent, dtype=np.float32), list(triplets))


def aligned(img: np.ndarray, sent: np.ndarray, triplets: Sequence[Triplet] | None, boxes: np.ndarray,
            blocks: int, labels: Sequence[str | None], evidence: SentenceEvidence | None
            ) -> tuple[list[FragmentMatch], Found | None]:
    """One pair's alignment (`matches`) and its phrase evidence (None without `evidence`)."""
    found = None if evidence is None else evidence.found(img)
    return matches(img, sent, triplets, boxes, blocks, labels, found), found


def label_at(labels: Sequence[str | None], fragment: int) -> str | None:
    """Fragment `fragment`'s detector label, None where it has none or none are known."""
    return labels[fragment] if fragment < len(labels) else None
