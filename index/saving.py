"""Saving an index: the commit protocol.

An index folder holds

    index.sqlite          metadata (one row per item) and the `info` table that names the current
                          store segments and candidate state: the commit point of every save
    faiss-*.index         the FAISS candidate index (ids: index.ids), with the FAISS backend
    store-*.npy           fragment vectors for the exact re-rank (memory-mapped)
    codes-*.npy           the prescore codes of the store's rows and their projection (index.codes),
                          with `IndexShape.codes`; derived at the save for every segment they lack

`save()` writes new files under fresh names (temp file, fsync, rename), makes the candidate state
durable (a new FAISS file; or a Milvus flush), then commits one SQLite transaction that points
`info` at them, then deletes the files (and Milvus collections) no longer named. A crash at any
point before the commit leaves the previous state loadable. A Milvus collection lives outside the
folder and sees writes before they are committed: the first write after a load reconciles it with
the committed state (index.milvus).

A save holds the index's writer lock (writes are serialised) and an exclusive lock on the folder
across processes; searches go on meanwhile and see the new state once it is committed (the in-memory
switch takes the exclusive side of the readers-writer lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fragsearch.index.ann import FAISS_PREFIX
from fragsearch.index.candidates import CandidateBackend
from fragsearch.index.catalogue import Catalogue
from fragsearch.index.codes import CODES_PREFIX, CodesInfo, PrescoreCodes, derive
from fragsearch.index.compaction import STORE_PREFIX, STORE_SUFFIX, compact
from fragsearch.index.files import unique_name
from fragsearch.index.items import ItemTable
from fragsearch.index.locks import ReadWriteLock
from fragsearch.index.store import VectorStore
from fragsearch.index.stored import StoredFragments
from fragsearch.index.types import IndexFullError, IndexSettings
from fragsearch.model.atomic import TMP_SUFFIX, fsync_dir

LOCK_FILE = ".writer.lock"
FULL = (errno.ENOSPC, errno.EDQUOT)


class SavedIndex(Protocol):
    """What a save reads and adopts of an index (index.base.FragmentIndex)."""

    root: Path
    dim: int
    settings: IndexSettings
    catalogue: Catalogue
    store: VectorStore
    items: ItemTable[Any]
    stored: StoredFragments
    codes: PrescoreCodes | None
    candidates: CandidateBackend
    generation: int
    bulk_depth: int
    replaced: list[CandidateBackend]
    writer: threading.RLock
    rw: ReadWriteLock

    def reconcile(self) -> None: ...
    def row(self, payload: Any) -> tuple[Any, ...]: ...


def save(index: SavedIndex) -> None:
    """Make the current state of `index` durable, atomically (see the module docstring)."""
    with index.writer, file_lock(index.root):
        if index.bulk_depth:
            raise RuntimeError("save() inside bulk(): leave the bulk block first")
        index.reconcile()
        gen = index.generation + 1
        created: list[Path] = []
        store, items = index.store, index.items
        try:
            files, rows = list(store.files), store.segment_rows()
            seg, off = items.seg.copy(), items.off.copy()
            if store.live_rows:
                name = unique_name(STORE_PREFIX, gen, STORE_SUFFIX)
                created.append(index.root / name)
                rows.append(store.write_live(index.root / name))
                files.append(name)
            files, rows = compact(index.root, store, items, gen, files, rows, seg, off, created)
            codes_info = derive(index.root, store, files, rows, index.settings.shape.codes, index.codes,
                                lambda size: index.stored.sample(items.live(), size), gen, created,
                                refine=index.settings.shape.refine_codes)
            backend_info = index.candidates.persist(index.root, gen, created)
            commit(index, gen, files, rows, seg, off, {**backend_info, "codes": codes_info and codes_info.to_dict()})
        except BaseException as e:
            for path in created:
                with contextlib.suppress(OSError):
                    path.unlink()
            if disk_full(e):
                raise IndexFullError(index.root, e) from e
            raise
        arrays = [store.segments[store.files.index(f)] if f in store.files
                  else VectorStore.open_segment(index.root / f, index.dim, store.dtype, r)
                  for f, r in zip(files, rows, strict=True)]
        codes = committed_codes(index, codes_info, rows)
        with index.rw.write():
            store.commit(files, arrays)
            index.codes = codes
            items.seg[: len(seg)], items.off[: len(off)] = seg, off
            items.saved()
            index.generation = gen
            index.candidates.committed(backend_info)
        keep = set(files) | index.candidates.keeps()
        if codes_info is not None:
            keep |= codes_info.names()
        remove_unreferenced(index, keep)
        index.catalogue.checkpoint()


def committed_codes(index: SavedIndex, info: CodesInfo | None, rows: list[int]) -> PrescoreCodes | None:
    """The codes a commit named, the files already open kept open."""
    if info is None:
        return None
    return PrescoreCodes.open(index.root, info, index.dim, rows, opened=index.codes)


def commit(index: SavedIndex, gen: int, files: list[str], rows: list[int], seg: np.ndarray, off: np.ndarray,
           backend_info: dict[str, Any]) -> None:
    """One catalogue transaction: new items, removals, moved rows, and `info` naming the new state."""
    items = index.items
    added = ((i, int(items.n[i]), int(seg[i]), int(off[i]), int(not items.alive[i]), *index.row(p))
             for i, p in sorted(items.pending.items()))
    moved = np.flatnonzero((seg != items.seg[: len(seg)]) | (off != items.off[: len(off)]))
    info = {"generation": gen, "next_id": items.next_id, "settings": index.settings.to_dict(),
            "segments": [{"file": f, "rows": r} for f, r in zip(files, rows, strict=True)], **backend_info}
    index.catalogue.commit(index.generation, added, sorted(items.removed),
                           ((int(seg[i]), int(off[i]), int(i)) for i in moved if int(i) not in items.pending), info)


def remove_unreferenced(index: SavedIndex, keep: set[str]) -> None:
    """Delete store / FAISS files and temp files that the committed state does not name, and the
    backends a rebuild replaced."""
    for path in index.root.iterdir():
        name = path.name
        ours = (name.startswith((STORE_PREFIX + "-", FAISS_PREFIX + "-", CODES_PREFIX + "-"))
                or (name.startswith(".") and name.endswith(TMP_SUFFIX)))
        if ours and name not in keep:
            with contextlib.suppress(OSError):
                path.unlink()
    fsync_dir(index.root)
    replaced, index.replaced = index.replaced, []
    for old in replaced:
        old.discard()
    index.candidates.drop_unreferenced()


@contextlib.contextmanager
def file_lock(root: Path) -> Iterator[None]:
    """Exclusive lock on the folder across processes while a save runs."""
    with open(root / LOCK_FILE, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def disk_full(e: BaseException) -> bool:
    """A write failed for want of space: ENOSPC / EDQUOT, SQLite's SQLITE_FULL, or FAISS's write error
    (a RuntimeError that carries only the OS's reason as text)."""
    if isinstance(e, OSError):
        return e.errno in FULL
    if isinstance(e, sqlite3.OperationalError):
        return "full" in str(e).lower()
    return isinstance(e, RuntimeError) and any(os.strerror(code) in str(e) for code in FULL)
