"""Identical fragment vectors held once in FAISS (the sentence side: one triplet, many captions).

With fixed word vectors, "det(dog, a)" embeds to the same vector in every caption that has it; in
FAISS those copies would fill a query fragment's k' neighbours with one vector. Here each distinct
stored vector has one representative FAISS id — (the smallest live item holding it, its first row
there) — and a posting list of the items holding it, once per occurrence. The representatives are a
function of the live items, so they are recomputed from the store at load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from fragsearch.index import ids as fid


def digest(row: np.ndarray) -> bytes:
    """Content key of one stored fragment vector."""
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest()


class SharedFragments:
    """Representatives and posting lists of distinct fragment vectors."""

    def __init__(self) -> None:
        self.rep_of: dict[bytes, int] = {}  # vector key -> representative FAISS id
        self.key_of: dict[int, bytes] = {}  # representative FAISS id -> vector key
        self.postings: dict[bytes, list[int]] = {}  # vector key -> items holding it (per occurrence)
        self.item_keys: dict[int, list[bytes]] = {}  # live item -> the keys of its rows, in order
        self._table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # postings as arrays (cache)

    def __len__(self) -> int:
        return len(self.rep_of)

    def add(self, item: int, rows: np.ndarray) -> list[int]:
        """Register an item's stored rows (n, h); returns the rows that became representatives."""
        keys = [digest(r) for r in rows]
        self.item_keys[item] = keys
        self._table = None
        new = []
        for f, key in enumerate(keys):
            posting = self.postings.get(key)
            if posting is None:
                self.postings[key] = [item]
                rep = int(fid.encode(item, f))
                self.rep_of[key], self.key_of[rep] = rep, key
                new.append(f)
            else:
                posting.append(item)
        return new

    def remove(self, item: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Unregister an item: (representative ids to drop from FAISS, (item, row) of the
        representatives that replace them)."""
        drop: list[int] = []
        moved: list[tuple[int, int]] = []
        self._table = None
        for key in dict.fromkeys(self.item_keys.pop(item, [])):
            posting = [i for i in self.postings[key] if i != item]
            rep = self.rep_of[key]
            if int(rep >> fid.FRAGMENT_BITS) == item:
                drop.append(rep)
                del self.key_of[rep]
                if posting:
                    owner = min(posting)
                    row = self.item_keys[owner].index(key)
                    new = int(fid.encode(owner, row))
                    self.rep_of[key], self.key_of[new] = new, key
                    moved.append((owner, row))
                else:
                    del self.rep_of[key]
            if posting:
                self.postings[key] = posting
            else:
                del self.postings[key]
        return drop, moved

    def representatives(self, items: Iterable[int]) -> list[tuple[int, int]]:
        """(item, row) of the representatives held by `items`."""
        out = []
        for item in items:
            for row, key in enumerate(self.item_keys.get(int(item), [])):
                if self.rep_of.get(key) == int(fid.encode(item, row)):
                    out.append((int(item), row))
        return out

    def postings_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(representative ids ascending, indptr, items): the posting lists as arrays, built on first
        use after a change."""
        table = self._table
        if table is None:
            reps = np.sort(np.fromiter(self.key_of, dtype=np.int64, count=len(self.key_of)))
            lists = [self.postings[self.key_of[int(r)]] for r in reps]
            indptr = np.zeros(len(reps) + 1, dtype=np.int64)
            np.cumsum([len(p) for p in lists], out=indptr[1:])
            items = np.fromiter((i for p in lists for i in p), dtype=np.int64, count=int(indptr[-1]))
            table = self._table = (reps, indptr, items)
        return table

    def expand(self, ids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """FAISS hits (representative ids, scores) -> (item, positive score) once per occurrence of the
        vector in an item (hits of one representative are summed first)."""
        reps, indptr, items = self.postings_table()
        uniq, where = np.unique(ids, return_inverse=True)
        weight = np.bincount(where, weights=np.maximum(scores, 0), minlength=len(uniq))
        pos = np.minimum(np.searchsorted(reps, uniq), max(0, len(reps) - 1))
        known = (reps[pos] == uniq) if len(reps) else np.zeros(len(uniq), bool)  # else: removed (hnsw keeps it)
        pos, weight = pos[known], weight[known]
        starts, lengths = indptr[pos], indptr[pos + 1] - indptr[pos]
        shift = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        return items[shift + np.arange(int(lengths.sum()))], np.repeat(weight, lengths)
