"""The stored fragments of items, read back from the re-rank store (index.store) through the item
table (index.items): what the exact re-rank scores (index.ranker), and what a candidate backend is
fed when it is rebuilt or resynchronised (index.base). Readers hold the index's `reading()` lock."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from fragsearch.index import ids as fid
from fragsearch.index.candidates import Sources, entries_batches
from fragsearch.index.items import ItemTable
from fragsearch.index.shared import SharedFragments
from fragsearch.index.store import VectorStore

ADD_ITEMS = 512  # items whose fragments go into the candidate backend in one call while rebuilding
SAMPLE_SEED = 0


class StoredFragments:
    """Views of the store by item: rows, padded batches, backend entries, random samples."""

    def __init__(self, items: ItemTable[Any], store: VectorStore, shared: SharedFragments | None) -> None:
        self.items = items
        self.store = store
        self.shared = shared
        self.dim = store.dim

    def rows(self, item: int) -> np.ndarray:
        """(n, dim) stored rows of one item (a view, in the store dtype)."""
        return self.store.rows(int(self.items.seg[item]), int(self.items.off[item]), int(self.items.n[item]))

    def vectors(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stored fragments of `items`: (C, F_max, dim) float32 and mask (C, F_max) float32."""
        vecs, mask = self.store.gather(self.items.seg[items], self.items.off[items], self.items.n[items])
        return vecs, mask.astype(np.float32)

    def fragment_vectors(self, items: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Stored vectors (N, dim) float32 of fragment `rows` of `items` (each (N,))."""
        vecs, _ = self.store.gather(self.items.seg[items], self.items.off[items] + rows,
                                    np.ones(len(items), np.int32))
        return vecs[:, 0]

    def item_vectors(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fragment ids (N,) and vectors (N, dim) float32 of `items`, all their fragments."""
        vecs, mask = self.store.gather(self.items.seg[items], self.items.off[items], self.items.n[items])
        ids = fid.encode(items[:, None], np.arange(vecs.shape[1])[None, :])
        return ids[mask], vecs[mask]

    def rows_of(self, pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(item, row) pairs -> their fragment ids (N,) and stored vectors (N, dim) float32."""
        if not pairs:
            return np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)
        items = np.asarray([i for i, _ in pairs], dtype=np.int64)
        rows = np.asarray([r for _, r in pairs], dtype=np.int64)
        return fid.encode(items, rows), self.fragment_vectors(items, rows)

    def entries(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What `items` put into the backend: fragment ids (N,) and vectors (N, dim) float32 (with
        shared fragments, only the representatives they hold)."""
        if self.shared is None:
            return self.item_vectors(items)
        return self.rows_of(self.shared.representatives(items.tolist()))

    def batches(self, items: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The backend entries of `items`, ADD_ITEMS items at a time."""
        return entries_batches(items, ADD_ITEMS, self.entries)

    def sources(self, items: np.ndarray) -> Sources:
        """The entries of `items` for a backend's rebuild or resynchronisation."""
        return Sources(batches=lambda: self.batches(items), total=self.items.fragments(items),
                       sample=lambda size: self.sample(items, size))

    def sample(self, items: np.ndarray, size: int) -> np.ndarray:
        """Up to `size` fragment vectors drawn at random from `items`."""
        rng = np.random.default_rng(SAMPLE_SEED)
        total = self.items.fragments(items)
        if total <= size:
            return self.item_vectors(items)[1]
        per_item = max(1, int(np.ceil(size / max(1, len(items)))))
        chosen = np.sort(rng.choice(len(items), size=min(len(items), int(np.ceil(size / per_item))), replace=False))
        picked = items[chosen]
        counts = self.items.n[picked].astype(np.int64)
        if counts.sum() <= size:
            return self.item_vectors(picked)[1]
        # the positions drawn in the chosen items' fragments laid end to end, read one by one: the
        # sample costs its own size in memory, not the chosen items' every fragment
        keep = np.sort(rng.choice(int(counts.sum()), size=size, replace=False))
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        owner = np.searchsorted(starts, keep, side="right") - 1
        return self.fragment_vectors(picked[owner], keep - starts[owner])
