"""FAISS ids of fragments: one int64 holds the item (image or sentence) id and the fragment's row.

    faiss_id = item_id * 2**FRAGMENT_BITS + fragment
"""

from __future__ import annotations

import numpy as np

FRAGMENT_BITS = 10
MAX_FRAGMENTS = 1 << FRAGMENT_BITS  # fragments one item may have
MAX_ITEM = (1 << (63 - FRAGMENT_BITS)) - 1
MAX_ID = 2**63 - 1  # the largest id an API caller may name: ids are int64 in FAISS and SQLite


def encode(item: int | np.ndarray, fragment: int | np.ndarray) -> np.ndarray:
    """(item, fragment) -> int64 FAISS ids (broadcasting). Raises ValueError when out of range."""
    items = np.asarray(item, dtype=np.int64)
    frags = np.asarray(fragment, dtype=np.int64)
    if items.size and (items.min() < 0 or items.max() > MAX_ITEM):
        raise ValueError(f"item ids must be in [0, {MAX_ITEM}]")
    if frags.size and (frags.min() < 0 or frags.max() >= MAX_FRAGMENTS):
        raise ValueError(f"fragment rows must be in [0, {MAX_FRAGMENTS}); an item has at most {MAX_FRAGMENTS}")
    return (items << FRAGMENT_BITS) | frags


def decode(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 FAISS ids -> (item ids, fragment rows), same shape. Negative ids (FAISS 'none') stay -1."""
    ids = np.asarray(ids, dtype=np.int64)
    items = np.where(ids >= 0, ids >> FRAGMENT_BITS, -1)
    frags = np.where(ids >= 0, ids & (MAX_FRAGMENTS - 1), -1)
    return items, frags


def item_fragments(item: int, n: int) -> np.ndarray:
    """The (n,) FAISS ids of an item's fragments 0..n-1."""
    return encode(item, np.arange(n, dtype=np.int64))


def item_range(item: int) -> tuple[int, int]:
    """[lo, hi) FAISS id range holding every fragment of `item`."""
    return item << FRAGMENT_BITS, (item + 1) << FRAGMENT_BITS
