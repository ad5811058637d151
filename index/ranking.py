"""Top-k helpers of the exact re-rank: ties always go to the smaller item id, as in the final ranking."""

from __future__ import annotations

import numpy as np


def top_k(scores: np.ndarray, items: np.ndarray, k: int) -> list[tuple[int, int, float]]:
    """The k best (position, item, score) by score, ties broken by the smaller item id."""
    if len(items) == 0 or k <= 0:
        return []
    order = np.lexsort((items, -scores))[:k]
    return [(int(p), int(items[p]), float(scores[p])) for p in order]


def merge_top_k(best: list[tuple[int, float]], items: np.ndarray, scores: np.ndarray, k: int
                ) -> list[tuple[int, float]]:
    """Running top-k over chunks of an exhaustive scan: (item, score) pairs."""
    merged = best + [(int(i), float(s)) for _, i, s in top_k(scores, items, k)]
    merged.sort(key=lambda t: (-t[1], t[0]))
    return merged[:k]
