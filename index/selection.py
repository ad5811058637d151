"""The k best of many scores without sorting them all, ties to the smaller item id (the order of every
ranking the indexes return)."""

from __future__ import annotations

import numpy as np


def best_positions(scores: np.ndarray, items: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k best by score, ties broken by the smaller item id (the same k as `top_k`),
    in ascending position order: a partial selection, not a sort of every score."""
    if k >= len(scores):
        return np.arange(len(scores))
    if k <= 0:
        return np.zeros(0, np.int64)
    cut = np.partition(scores, len(scores) - k)[len(scores) - k]  # the k-th best score
    above = np.flatnonzero(scores > cut)
    tied = np.flatnonzero(scores == cut)
    tied = tied[np.argsort(items[tied], kind="stable")[: k - len(above)]]
    return np.sort(np.concatenate([above, tied]))
