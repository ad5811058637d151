"""Merging re-rank store segments at a save: when there are many, or they hold many removed rows.

Runs inside `FragmentIndex.save` before the commit: the merged rows go to a new segment file, and
the item table's (segment, offset) copies passed in are updated in place; the commit names the
result, and the files no longer named are deleted after it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.index.files import unique_name
from fragsearch.index.items import ItemTable
from fragsearch.index.store import VectorStore

logger = logging.getLogger(__name__)

STORE_PREFIX, STORE_SUFFIX = "store", ".npy"
MAX_SEGMENTS = 16  # more saved segments than this: the smaller half is merged at the next save
DEAD_SHARE = 0.5  # share of store rows belonging to removed items that triggers a full rewrite


def smaller_half(rows: list[int]) -> list[int]:
    """The segments a save merges when there are too many: the smaller half by rows (ascending numbers)."""
    return sorted(np.argsort(rows, kind="stable")[: len(rows) // 2].tolist())


def merged_rows(moving: np.ndarray, seg: np.ndarray, off: np.ndarray, n: np.ndarray
                ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Items to merge in file order, and their (segment, offset, n) as `VectorStore.write_items` takes them."""
    moving = moving[np.lexsort((off[moving], seg[moving]))]
    return moving, [(int(seg[i]), int(off[i]), int(n[i])) for i in moving]


def compact(root: Path, store: VectorStore, items: ItemTable[Any], gen: int, files: list[str], rows: list[int],
            seg: np.ndarray, off: np.ndarray, created: list[Path]) -> tuple[list[str], list[int]]:
    """The segments (files, rows) after merging; updates `seg` / `off` (copies of the item table's) in place."""
    n_items = items.next_id
    alive = items.alive[:n_items]
    has_rows = seg[:n_items] >= 0
    dead_rows = int(items.n[:n_items][has_rows & ~alive].sum())
    total = sum(rows)
    if total and dead_rows > DEAD_SHARE * total:
        merge = list(range(len(files)))
    elif len(files) > MAX_SEGMENTS:
        merge = smaller_half(rows)
    else:
        return files, rows
    in_merge = np.isin(seg[:n_items], merge)
    moving, locs = merged_rows(np.flatnonzero(in_merge & alive), seg, off, items.n)
    name = unique_name(STORE_PREFIX, gen, STORE_SUFFIX)
    created.append(Path(root) / name)
    # rows of the segment just written from the live rows are read from memory (store.rows)
    new_offsets = store.write_items(Path(root) / name, locs)
    keep = [s for s in range(len(files)) if s not in merge]
    renumber = np.full(len(files), -1, np.int64)
    renumber[keep] = np.arange(len(keep))
    dropped = np.flatnonzero(in_merge & ~alive)
    stay = np.flatnonzero(~in_merge & has_rows)
    seg[stay] = renumber[seg[stay]]
    seg[dropped] = -1
    seg[moving] = len(keep)
    off[moving] = new_offsets
    logger.info("merged %d store segments of %s (%d rows kept, %d removed rows dropped)", len(merge), root,
                sum(n for _, _, n in locs), int(items.n[dropped].sum()))
    return [files[s] for s in keep] + [name], [rows[s] for s in keep] + [sum(n for _, _, n in locs)]
