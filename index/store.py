"""The re-rank store: every item's fragment vectors, read back exactly for S_kl.

Vectors live in segments; an item's rows are contiguous inside one segment. Saved segments are
`.npy` files opened memory-mapped (so a large collection is paged in on demand); rows added since
the last save sit in in-memory blocks (the live segment, numbered after the saved ones).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from model.atomic import atomic_path

BLOCK_ROWS = 1 << 16  # rows per in-memory block of the live segment


class VectorStore:
    """Fragment vectors (rows, dim) in `dtype` (float32 or float16)."""

    def __init__(self, dim: int, dtype: str) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.segments: list[np.ndarray] = []  # saved, read-only
        self.files: list[str] = []
        self._blocks: list[np.ndarray] = []
        self._starts: list[int] = []
        self._fill = 0  # rows used in the last block
        self.live_rows = 0

    # -- layout -----------------------------------------------------------------------------------
    @property
    def live_segment(self) -> int:
        """Segment number of rows appended since the last save."""
        return len(self.segments)

    def segment_rows(self) -> list[int]:
        return [len(s) for s in self.segments]

    @property
    def bytes_per_row(self) -> int:
        return self.dim * self.dtype.itemsize

    # -- writes -----------------------------------------------------------------------------------
    def append(self, vecs: np.ndarray) -> tuple[int, int]:
        """vecs: (n, dim) -> (segment, row offset) of the item's rows."""
        n = len(vecs)
        if vecs.ndim != 2 or vecs.shape[1] != self.dim:
            raise ValueError(f"vectors of shape {vecs.shape}, expected (n, {self.dim})")
        if not self._blocks or self._fill + n > len(self._blocks[-1]):
            self._blocks.append(np.empty((max(BLOCK_ROWS, n), self.dim), dtype=self.dtype))
            self._starts.append(self.live_rows)
            self._fill = 0
        self._blocks[-1][self._fill : self._fill + n] = vecs
        off = self.live_rows
        self._fill += n
        self.live_rows += n
        return self.live_segment, off

    def write_live(self, path: Path) -> int:
        """Write the live rows to `path` (atomically) as one .npy file; returns the rows written."""
        with atomic_path(path) as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=self.dtype, shape=(self.live_rows, self.dim))
            ends = [*self._starts[1:], self.live_rows]
            for block, start, end in zip(self._blocks, self._starts, ends, strict=True):
                out[start:end] = block[: end - start]
            out.flush()
            del out
        return self.live_rows

    def write_items(self, path: Path, locs: Sequence[tuple[int, int, int]]) -> list[int]:
        """Write the rows of items at (segment, offset, n) one after another into a new .npy file.

        Returns each item's row offset in the new file.
        """
        total = sum(n for _, _, n in locs)
        offsets: list[int] = []
        with atomic_path(path) as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=self.dtype, shape=(total, self.dim))
            pos = 0
            for seg, off, n in locs:
                out[pos : pos + n] = self.rows(seg, off, n)
                offsets.append(pos)
                pos += n
            out.flush()
            del out
        return offsets

    def commit(self, files: list[str], arrays: list[np.ndarray]) -> None:
        """Adopt a new list of saved segments (after a save); the live rows are dropped."""
        self.files = list(files)
        self.segments = list(arrays)
        self._blocks, self._starts, self._fill, self.live_rows = [], [], 0, 0

    @staticmethod
    def open_segment(path: Path, dim: int, dtype: np.dtype, rows: int) -> np.ndarray:
        """Memory-map a saved segment; ValueError when its shape or dtype is not the expected one."""
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        if arr.ndim != 2 or arr.shape != (rows, dim) or arr.dtype != dtype:
            raise ValueError(f"{path.name}: {arr.dtype} {arr.shape}, expected {dtype} ({rows}, {dim})")
        return arr

    # -- reads ------------------------------------------------------------------------------------
    def rows(self, seg: int, off: int, n: int) -> np.ndarray:
        """(n, dim) rows of one item (a view, in the store dtype)."""
        if seg < len(self.segments):
            return self.segments[seg][off : off + n]
        if seg != self.live_segment or off + n > self.live_rows:
            raise IndexError(f"rows {off}..{off + n} of segment {seg} do not exist")
        b = bisect.bisect_right(self._starts, off) - 1
        local = off - self._starts[b]
        return self._blocks[b][local : local + n]

    def gather(self, seg: np.ndarray, off: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Items at (seg, off, n), each (C,) -> vectors (C, F_max, dim) float32 and mask (C, F_max)."""
        count = len(seg)
        f_max = int(n.max()) if count else 1
        out = np.zeros((count, f_max, self.dim), dtype=np.float32)
        mask = np.arange(f_max)[None, :] < n[:, None]
        for s in np.unique(seg):
            sel = np.flatnonzero(seg == s)
            if s >= len(self.segments):
                for i in sel:
                    out[i, : n[i]] = self.rows(int(s), int(off[i]), int(n[i]))
                continue
            segment = self.segments[int(s)]
            first = int(off[sel[0]])
            if (n[sel] == f_max).all() and (np.diff(off[sel]) == f_max).all():  # one contiguous run
                out[sel] = segment[first : first + len(sel) * f_max].reshape(len(sel), f_max, self.dim)
                continue
            rows = (off[sel, None] + np.arange(f_max)[None, :])[mask[sel]]
            order = np.argsort(rows, kind="stable")  # read the memory map in file order
            values = np.empty((len(rows), self.dim), dtype=np.float32)
            values[order] = segment[rows[order]]
            dest = out[sel]
            dest[mask[sel]] = values
            out[sel] = dest
        return out, mask
