"""The item table in memory: where each item's fragments sit in the re-rank store, and whether it is live.

Item ids are dense (0 .. next_id - 1) and never reused. Per id: segment (-1 once its rows are dropped
by a compaction), row offset, fragment count, alive. Items added since the last save keep their
payload in `pending`; saved items removed since then are in `removed`.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import numpy as np

P = TypeVar("P")
MIN_CAPACITY = 1024


class ItemTable(Generic[P]):
    """seg, off, n, alive: arrays indexed by item id (capacity grows by doubling)."""

    def __init__(self) -> None:
        self.seg = np.zeros(0, np.int32)
        self.off = np.zeros(0, np.int64)
        self.n = np.zeros(0, np.int32)
        self.alive = np.zeros(0, bool)
        self.count = 0
        self.next_id = 0
        self.pending: dict[int, P] = {}  # added since the last save
        self.removed: set[int] = set()  # saved items removed since the last save

    def grow(self, size: int) -> None:
        if size <= len(self.alive):
            return
        cap = max(size, 2 * len(self.alive), MIN_CAPACITY)
        for name, fill in (("seg", -1), ("off", 0), ("n", 0), ("alive", False)):
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def load(self, rows: np.ndarray, next_id: int) -> None:
        """Fill from catalogue rows (N, 5): id, seg, off, n, deleted."""
        self.next_id = next_id
        self.grow(next_id)
        if len(rows):
            item = rows[:, 0]
            self.seg[item], self.off[item], self.n[item] = rows[:, 1], rows[:, 2], rows[:, 3]
            self.alive[item] = rows[:, 4] == 0
        self.count = int(self.alive.sum())

    def place(self, item: int, seg: int, off: int, n: int, payload: P) -> None:
        """A new item's rows in the store (the caller has grown the table)."""
        self.seg[item], self.off[item], self.n[item] = seg, off, n
        self.pending[item] = payload
        self.alive[item] = True
        self.count += 1

    def kill(self, item: int) -> None:
        """Mark a live item removed."""
        self.alive[item] = False
        self.count -= 1
        if item not in self.pending:
            self.removed.add(item)

    def contains(self, item: int) -> bool:
        return 0 <= item < len(self.alive) and bool(self.alive[item])

    def live(self) -> np.ndarray:
        """Ids of the live items, ascending."""
        return np.flatnonzero(self.alive)

    def live_among(self, items: np.ndarray) -> np.ndarray:
        """Mask of `items` (any int64 ids, e.g. from a candidate backend) that are live here."""
        inside = (items >= 0) & (items < len(self.alive))
        out = np.zeros(len(items), bool)
        out[inside] = self.alive[items[inside]]
        return out

    def fragments(self, items: np.ndarray | None = None) -> int:
        """Fragments of `items` (default: of every live item)."""
        return int(self.n[self.alive if items is None else items].sum())

    def saved(self) -> None:
        """Forget what the last save committed."""
        self.pending.clear()
        self.removed.clear()
