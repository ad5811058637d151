"""The re-rank store: every item's fragment vectors, read back for S_kl.

Vectors live in segments; an item's rows are contiguous inside one segment. Saved segments are
`.npy` files opened memory-mapped (so a large collection is paged in on demand); rows added since
the last save form the live segment (numbered after the saved ones): in-memory blocks, and, once
they pass `SPILL_BYTES` in a store that has a folder (an index's store: its folder), a spill file there that the next
save turns into the new segment without a copy (a hard link under the segment's fresh name). A
bulk load of millions of fragments therefore holds at most `SPILL_BYTES` of them in memory. The spill
file is a temp file (`fragsearch.model.atomic.temp_path`): no commit names it, so a crash leaves the last
committed state and the next save removes it.

Precisions (`IndexShape.store_dtype`): float32, float16 (the default for large collections), and
int8: each fragment scaled by its largest absolute coordinate / 127 and rounded, the scale kept
as a float32 in the row's last 4 bytes (dim + 4 bytes a fragment; reads give q * scale).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import mmap
import os
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.model.atomic import atomic_path, temp_path

BLOCK_ROWS = 1 << 16  # rows per in-memory block of the live segment
SPILL_BYTES = 256 << 20  # live rows held in memory before they go to the spill file (stores with a folder)
HEADER_BYTES = 128  # .npy header of a spill file: fixed size, rewritten with the final shape at a save
SCALE_BYTES = 4  # int8 rows: the float32 scale after the dim codes
INT8_MAX = 127.0
DOT_ROWS = 4096  # rows decoded at a time by `dots`
WRITE_BYTES = 64 << 20  # rows buffered between two writes of `write_items`


def row_columns(dim: int, dtype: np.dtype) -> int:
    """Columns of a stored row: dim, or dim + the scale's 4 bytes for int8."""
    return dim + SCALE_BYTES if np.dtype(dtype) == np.int8 else dim


def npy_header(dtype: np.dtype, shape: tuple[int, int]) -> bytes:
    """A version 1.0 .npy header of exactly HEADER_BYTES bytes (space-padded, as numpy pads)."""
    text = repr({"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                 "shape": shape}).encode("latin1")
    size = HEADER_BYTES - 10
    if len(text) + 1 > size:
        raise ValueError(f"shape {shape} does not fit a {HEADER_BYTES}-byte header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", size) + text + b" " * (size - len(text) - 1) + b"\n"


def release_rows(segment: np.ndarray, lo: int, hi: int) -> None:
    """Drop rows lo .. hi - 1 of a memory-mapped array from this process's mapping (madvise
    DONTNEED: the pages stay in the kernel's cache, a later read maps them again); nothing for an
    array held in memory. A pass over many GB of mapped rows keeps its resident set bounded."""
    handle = getattr(segment, "_mmap", None)
    if not isinstance(segment, np.memmap) or handle is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    width = segment.shape[1] * segment.dtype.itemsize
    start = segment.offset % mmap.ALLOCATIONGRANULARITY + lo * width
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(start + (hi - lo) * width, len(handle))
    if end > first:
        handle.madvise(mmap.MADV_DONTNEED, first, end - first)


def mapping_of(path: Path, address: int) -> tuple[int, int] | None:
    """The range [start, end) of this process's memory mapping of the file `path` that holds `address`
    (/proc/self/maps), None where there is none (the bytes are not that file's mapping, or the system has no
    such table)."""
    try:
        target = os.stat(path)
        table = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in table:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[4] != str(target.st_ino):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end and os.path.realpath(fields[5]) == os.path.realpath(path):
            return start, end
    return None


def release_mapped(mapping: tuple[int, int], lo: int, hi: int) -> None:
    """Drop the whole pages of bytes lo .. hi - 1 (addresses) inside a file's read-only `mapping` (`mapping_of`)
    from this process (madvise DONTNEED, as `release_rows` does for a memory-mapped array; a later read maps
    them again from the kernel's cache). Nothing outside the mapping is ever released: DONTNEED on memory a
    process owns would zero it."""
    first = max(mapping[0], -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE)
    end = min(mapping[1], hi // mmap.PAGESIZE * mmap.PAGESIZE)
    if end <= first or not hasattr(mmap, "MADV_DONTNEED"):
        return
    _madvise()(first, end - first, mmap.MADV_DONTNEED)


@functools.cache
def _madvise() -> Any:
    """The C library's madvise(address, length, advice), found once (finding the library runs a program)."""
    import ctypes
    import ctypes.util

    call = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return call


class SpillFile:
    """Live rows on disk: an open temp file of raw rows after a fixed-size .npy header."""

    def __init__(self, folder: Path, dtype: np.dtype, cols: int) -> None:
        self.path = temp_path(Path(folder) / "store-live.npy")
        self.dtype, self.cols = np.dtype(dtype), cols
        self.row_bytes = cols * self.dtype.itemsize
        self.rows = 0
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.pwrite(self._fd, npy_header(self.dtype, (0, cols)), 0)

    def write(self, raw: np.ndarray) -> None:
        data = np.ascontiguousarray(raw, dtype=self.dtype).data
        pos, done = HEADER_BYTES + self.rows * self.row_bytes, 0
        view = memoryview(data).cast("B")
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], pos + done)
        self.rows += len(raw)

    def read(self, off: int, n: int) -> np.ndarray:
        """(n, cols) raw rows from row `off` (read with pread: no mapping, no resident pages)."""
        size = n * self.row_bytes
        buf = os.pread(self._fd, size, HEADER_BYTES + off * self.row_bytes)
        if len(buf) != size:
            raise OSError(f"{self.path}: short read of spilled rows {off}..{off + n}")
        return np.frombuffer(buf, dtype=self.dtype).reshape(n, self.cols)

    def finish(self) -> None:
        """Write the header of the current shape and make the file durable."""
        os.pwrite(self._fd, npy_header(self.dtype, (self.rows, self.cols)), 0)
        os.fsync(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class VectorStore:
    """Fragment vectors (rows, dim) in `dtype` (float32, float16 or int8); see the module docstring."""

    def __init__(self, dim: int, dtype: str, folder: Path | None = None) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.cols = row_columns(dim, self.dtype)
        self.folder = Path(folder) if folder is not None else None
        self.segments: list[np.ndarray] = []  # saved, read-only
        self.files: list[str] = []
        self._blocks: list[np.ndarray] = []
        self._starts: list[int] = []
        self._fill = 0  # rows used in the last block
        self._spill: SpillFile | None = None
        self.live_rows = 0
        self.read_ahead = True  # gathers prefetch their memory-mapped rows (`prefetch`)

    # -- layout -----------------------------------------------------------------------------------
    @property
    def live_segment(self) -> int:
        """Segment number of rows appended since the last save."""
        return len(self.segments)

    def segment_rows(self) -> list[int]:
        return [len(s) for s in self.segments]

    @property
    def bytes_per_row(self) -> int:
        return self.cols * self.dtype.itemsize

    @property
    def spilled_rows(self) -> int:
        """Live rows in the spill file (the rest are in memory)."""
        return self._spill.rows if self._spill is not None else 0

    # -- precision --------------------------------------------------------------------------------
    def encode(self, vecs: np.ndarray) -> np.ndarray:
        """(n, dim) float -> (n, cols) stored rows."""
        if self.dtype != np.int8:
            return np.asarray(vecs, dtype=self.dtype)
        x = np.asarray(vecs, dtype=np.float32)
        scale = np.abs(x).max(axis=1, keepdims=True) / INT8_MAX
        scale[scale == 0] = 1.0
        out = np.empty((len(x), self.cols), np.int8)
        out[:, : self.dim] = np.clip(np.rint(x / scale), -INT8_MAX, INT8_MAX)
        out[:, self.dim :] = scale.astype(np.float32).view(np.int8)
        return out

    def decode(self, raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """(n, cols) stored rows -> (n, dim) float32 (a new array, or written into `out`)."""
        if out is None:
            out = np.empty((len(raw), self.dim), np.float32)
        if self.dtype != np.int8:
            np.copyto(out, raw)
            return out
        return np.multiply(raw[:, : self.dim], self.scales(raw), out=out)  # one pass: int8 times the float32 scale

    def scales(self, raw: np.ndarray) -> np.ndarray:
        """The float32 scales (N, 1) of int8 rows (N, cols)."""
        if raw.flags.c_contiguous and self.cols % SCALE_BYTES == 0 and raw.ctypes.data % SCALE_BYTES == 0:
            return raw.view(np.float32)[:, -1:]  # the rows read as floats: the last is the scale (no byte copy)
        return np.ascontiguousarray(raw[:, self.dim :]).view(np.float32)

    # -- writes -----------------------------------------------------------------------------------
    def append(self, vecs: np.ndarray) -> tuple[int, int]:
        """vecs: (n, dim) -> (segment, row offset) of the item's rows."""
        n = len(vecs)
        if vecs.ndim != 2 or vecs.shape[1] != self.dim:
            raise ValueError(f"vectors of shape {vecs.shape}, expected (n, {self.dim})")
        if not self._blocks or self._fill + n > len(self._blocks[-1]):
            if self.folder is not None and self._memory_rows() * self.bytes_per_row >= SPILL_BYTES:
                self._spill_blocks()
            self._blocks.append(np.empty((max(BLOCK_ROWS, n), self.cols), dtype=self.dtype))
            self._starts.append(self.live_rows)
            self._fill = 0
        self._blocks[-1][self._fill : self._fill + n] = self.encode(vecs)
        off = self.live_rows
        self._fill += n
        self.live_rows += n
        return self.live_segment, off

    def _memory_rows(self) -> int:
        return self.live_rows - self.spilled_rows

    def _spill_blocks(self) -> None:
        """Move the in-memory live rows to the end of the spill file."""
        if not self._blocks:
            return
        if self._spill is None:
            assert self.folder is not None
            self._spill = SpillFile(self.folder, self.dtype, self.cols)
        ends = [*self._starts[1:], self.live_rows]
        for block, start, end in zip(self._blocks, self._starts, ends, strict=True):
            self._spill.write(block[: end - start])
        self._blocks, self._starts, self._fill = [], [], 0

    def write_live(self, path: Path) -> int:
        """Write the live rows to `path` (atomically) as one .npy file; returns the rows written.

        Spilled rows are not copied: the rest joins the spill file, which gets its final header and
        is linked under `path` (it stays the live rows' file until `commit`)."""
        if self._spill is not None:
            self._spill_blocks()
            self._spill.finish()
            with atomic_path(path) as tmp:
                try:
                    os.link(self._spill.path, tmp)
                except OSError:  # a file system without hard links: one copy
                    shutil.copyfile(self._spill.path, tmp)
            return self.live_rows
        with atomic_path(path) as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=self.dtype, shape=(self.live_rows, self.cols))
            ends = [*self._starts[1:], self.live_rows]
            for block, start, end in zip(self._blocks, self._starts, ends, strict=True):
                out[start:end] = block[: end - start]
            out.flush()
            del out
        return self.live_rows

    def write_items(self, path: Path, locs: Sequence[tuple[int, int, int]]) -> list[int]:
        """Write the rows of items at (segment, offset, n) one after another into a new .npy file.

        Returns each item's row offset in the new file. Written through a buffer of WRITE_BYTES (not a
        writable map), and the memory-mapped rows read are dropped from this process's mapping as the
        buffer is written (`release`): merging segments of many GB keeps its resident set bounded.
        """
        total = sum(n for _, _, n in locs)
        offsets: list[int] = []
        row_bytes = self.cols * self.dtype.itemsize
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            fh.write(npy_header(self.dtype, (total, self.cols)))
            pos, held = 0, 0
            parts: list[np.ndarray] = []
            read: dict[int, tuple[int, int]] = {}  # each segment's rows read since the last write
            for seg, off, n in locs:
                parts.append(np.ascontiguousarray(self.raw_rows(seg, off, n)))
                lo, hi = read.get(seg, (off, off + n))
                read[seg] = (min(lo, off), max(hi, off + n))
                offsets.append(pos)
                pos += n
                held += n * row_bytes
                if held >= WRITE_BYTES:
                    fh.write(b"".join(p.data for p in parts))
                    parts, held = [], 0
                    for s, (lo, hi) in read.items():
                        self.release(s, lo, hi)
                    read.clear()
            fh.write(b"".join(p.data for p in parts))
            for s, (lo, hi) in read.items():
                self.release(s, lo, hi)
            fh.flush()
            os.fsync(fh.fileno())
        return offsets

    def release(self, seg: int, lo: int, hi: int) -> None:
        """Drop rows lo .. hi - 1 of a memory-mapped saved segment from this process's mapping
        (`release_rows`)."""
        if 0 <= seg < len(self.segments):
            release_rows(self.segments[seg], lo, hi)

    def release_all(self) -> None:
        """Drop every memory-mapped saved segment's rows from this process's mapping (after a read
        that touched rows all over the store, such as a sample)."""
        for segment in self.segments:
            release_rows(segment, 0, len(segment))

    def commit(self, files: list[str], arrays: list[np.ndarray]) -> None:
        """Adopt a new list of saved segments (after a save); the live rows are dropped."""
        self.files = list(files)
        self.segments = list(arrays)
        self._blocks, self._starts, self._fill, self.live_rows = [], [], 0, 0
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    def close(self) -> None:
        """Drop the spill file (live rows not saved are lost)."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    @staticmethod
    def open_segment(path: Path, dim: int, dtype: np.dtype, rows: int, in_memory: bool = False) -> np.ndarray:
        """Memory-map (or read, `in_memory`) a saved segment; ValueError when its shape or dtype is not the
        expected one."""
        arr = np.load(path, mmap_mode=None if in_memory else "r", allow_pickle=False)
        cols = row_columns(dim, dtype)
        if arr.ndim != 2 or arr.shape != (rows, cols) or arr.dtype != dtype:
            raise ValueError(f"{path.name}: {arr.dtype} {arr.shape}, expected {dtype} ({rows}, {cols})")
        return arr

    # -- reads ------------------------------------------------------------------------------------
    def raw_rows(self, seg: int, off: int, n: int) -> np.ndarray:
        """(n, cols) stored rows of one item (a view where they are in memory or memory-mapped)."""
        if seg < len(self.segments):
            return self.segments[seg][off : off + n]
        if seg != self.live_segment or off + n > self.live_rows:
            raise IndexError(f"rows {off}..{off + n} of segment {seg} do not exist")
        if off < self.spilled_rows:
            assert self._spill is not None
            return self._spill.read(off, n)
        b = bisect.bisect_right(self._starts, off) - 1
        local = off - self._starts[b]
        return self._blocks[b][local : local + n]

    def rows(self, seg: int, off: int, n: int) -> np.ndarray:
        """(n, dim) rows of one item: a view in the store dtype for float stores, float32 for int8."""
        raw = self.raw_rows(seg, off, n)
        return self.decode(raw) if self.dtype == np.int8 else raw

    def prefetch(self, seg: np.ndarray, off: np.ndarray, n: np.ndarray) -> None:
        """Ask the kernel to read the memory-mapped rows of items (seg, off, n) ahead, all at once
        (madvise WILLNEED): a gather of scattered items then waits for their reads side by side
        instead of one page fault after another. Rows in memory, or a platform without it: nothing."""
        if not self.read_ahead or not hasattr(mmap, "MADV_WILLNEED") or not any(
                isinstance(s, np.memmap) for s in self.segments):  # in memory (the prescore codes): nothing to ask
            return
        for s in np.unique(seg):
            segment = self.segments[int(s)] if s < len(self.segments) else None
            handle = getattr(segment, "_mmap", None)
            if not isinstance(segment, np.memmap) or handle is None or not hasattr(handle, "madvise"):
                continue
            sel = seg == s
            width = segment.shape[1] * segment.dtype.itemsize
            # the map starts at the file offset rounded down to the allocation granularity (numpy.memmap)
            start = segment.offset % mmap.ALLOCATIONGRANULARITY + off[sel].astype(np.int64) * width
            first = start // mmap.PAGESIZE * mmap.PAGESIZE
            for a, b in zip(first.tolist(), (start + n[sel].astype(np.int64) * width).tolist(), strict=True):
                handle.madvise(mmap.MADV_WILLNEED, a, min(b, len(handle)) - a)

    def gather_rows(self, seg: np.ndarray, off: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Items at (seg, off, n), each (C,) -> their stored rows one item after another, in the items'
        order: (sum(n), cols) raw, no padding. Each saved segment is read in one vectorised take, in
        file order where the items come sorted by (seg, off)."""
        n = np.asarray(n, dtype=np.int64)
        off = np.asarray(off, dtype=np.int64)
        starts = np.cumsum(n) - n  # each item's first row in the output
        out = np.empty((int(n.sum()), self.cols), self.dtype)
        if len(seg) > 1:
            self.prefetch(seg, off, n)
        for s in np.unique(seg):
            sel = np.flatnonzero(seg == s)
            if s >= len(self.segments):
                for i in sel:
                    out[starts[i] : starts[i] + n[i]] = self.raw_rows(int(s), int(off[i]), int(n[i]))
                continue
            lens = n[sel]
            within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
            src = np.repeat(off[sel], lens) + within
            segment = self.segments[int(s)]
            if len(src) and (int(src.min()) < 0 or int(src.max()) >= len(segment)):
                raise IndexError(f"rows beyond the {len(segment)} of segment {s}")
            # bounds checked above: "clip" lets take write straight into `out` (its "raise" mode buffers)
            if sel[-1] - sel[0] + 1 == len(sel):  # consecutive items: one block of the output, no copy
                first = int(starts[sel[0]])
                np.take(segment, src, axis=0, out=out[first : first + len(src)], mode="clip")
            else:
                out[np.repeat(starts[sel], lens) + within] = np.take(segment, src, axis=0, mode="clip")
        return out

    def gather(self, seg: np.ndarray, off: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Items at (seg, off, n), each (C,) -> vectors (C, F_max, dim) float32 and mask (C, F_max)."""
        count = len(seg)
        f_max = int(n.max()) if count else 1
        mask = np.arange(f_max)[None, :] < n[:, None]
        view = self._run_view(seg, off, n, f_max)
        if view is not None:
            return view, mask
        out = np.zeros((count, f_max, self.dim), dtype=np.float32)
        raw = self.gather_rows(seg, off, n)
        if mask.all():  # every item has f_max rows: the output is the rows one after another
            self.decode(raw, out.reshape(-1, self.dim))
        else:
            out[mask] = self.decode(raw)
        return out, mask

    def _run_view(self, seg: np.ndarray, off: np.ndarray, n: np.ndarray, f_max: int) -> np.ndarray | None:
        """The items as a read-only view (C, F, dim) of a saved float32 segment, without a copy, where they are
        one run of it: the same segment, each right after the one before, all with F rows (an exact scan of
        a collection in file order). None otherwise."""
        if self.dtype != np.float32 or not len(seg) or int(seg[0]) >= len(self.segments):
            return None
        seg, off, n = np.asarray(seg), np.asarray(off, dtype=np.int64), np.asarray(n, dtype=np.int64)
        if not (np.all(seg == seg[0]) and np.all(n == f_max) and np.all(np.diff(off) == f_max)):
            return None
        segment = self.segments[int(seg[0])]
        first = int(off[0])
        if first < 0 or first + len(n) * f_max > len(segment):
            raise IndexError(f"rows beyond the {len(segment)} of segment {int(seg[0])}")
        view = np.asarray(segment[first : first + len(n) * f_max]).reshape(len(n), f_max, self.dim)
        view.flags.writeable = False
        return view

    def dots(self, raw: np.ndarray, queries: np.ndarray) -> np.ndarray:
        """Inner products (N, t) float32 of stored rows `raw` (N, cols), decoded, with queries (t, dim) float32;
        int8 rows: the codes' products times each row's scale (the decode folded into the product).
        Decoded DOT_ROWS rows at a time, so the float copy stays in the cache."""
        out = np.empty((len(raw), len(queries)), np.float32)
        qt = np.ascontiguousarray(np.asarray(queries, dtype=np.float32).T)  # (dim, t): the skinny product's order
        decoded = np.empty((min(DOT_ROWS, len(raw)), self.dim), np.float32)  # one buffer, reused
        for start in range(0, len(raw), DOT_ROWS):
            part = np.asarray(raw[start : start + DOT_ROWS, : self.dim])
            rows = decoded[: len(part)]
            np.copyto(rows, part)
            np.matmul(rows, qt, out=out[start : start + len(part)])
        if self.dtype == np.int8:
            out *= np.ascontiguousarray(self.scales(raw))
        return out
