"""Alignments as results: which image region each sentence fragment matched, with its triplet and box."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from index.types import FragmentMatch
from model.score import align
from model.text import Triplet


def matches(img: np.ndarray, sent: np.ndarray, triplets: Sequence[Triplet] | None,
            boxes: np.ndarray, blocks: int = 1, labels: Sequence[str | None] = ()) -> list[FragmentMatch]:
    """The alignment of one image-sentence pair as results, in sentence-fragment order.

    img: (F, h) image fragments with boxes (F, 4) and their detector labels (empty: none known); sent: (T, h)
    sentence fragments with their triplets. Sentence fragments without a positive match (no share in S_kl) are
    left out. `blocks`: the model's (``Bundle.blocks``; a merged model aligns by the thresholded pair score,
    model/score.py).
    """
    al = align(img, sent, blocks)
    out = []
    for j, (i, score, ok) in enumerate(zip(al.image_fragment, al.score, al.matched, strict=True)):
        if not ok:
            continue
        t = triplets[j] if triplets else Triplet("", f"fragment {j}", f"fragment {j}")
        out.append(FragmentMatch(triplet=t.text() if triplets else f"fragment {j}", relation=t.rel,
                                 words=(t.w1, t.w2), box=[float(v) for v in boxes[i]], fragment=int(i),
                                 score=float(score), label=label_at(labels, int(i))))
    return out


def label_at(labels: Sequence[str | None], fragment: int) -> str | None:
    """Fragment `fragment`'s detector label, None where it has none or none are known."""
    return labels[fragment] if fragment < len(labels) else None
