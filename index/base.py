"""The storage machinery both indexes share: FAISS candidates, the re-rank store, SQLite metadata.

An index folder holds

    index.sqlite          metadata (one row per item) and the `info` table that names the current
                          FAISS file and store segments: the commit point of every save
    faiss-*.index         the candidate index (ids: index.ids)
    store-*.npy           fragment vectors for the exact re-rank (memory-mapped)

`save()` writes new files under fresh names (temp file, fsync, rename), then commits one SQLite
transaction that points `info` at them, then deletes the files no longer named. A crash at any
point before the commit leaves the previous state loadable.

Concurrency: searches run under the shared side of a readers-writer lock; writers are serialised
by an RLock, do their slow work (extraction, embedding, file writes) without blocking searches and
take the exclusive side only to mutate in-memory state.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch

from index import ids as fid
from index.ann import AnnIndex, train_sample_size
from index.files import TMP_SUFFIX, atomic_path, fsync_dir, sha256_file, unique_name
from index.fingerprint import model_fingerprint
from index.locks import ReadWriteLock
from index.shared import SharedFragments
from index.store import VectorStore
from index.types import IndexFullError, IndexLoadError, IndexSettings
from model.bundle import Bundle
from model.image import RegionExtractor

logger = logging.getLogger(__name__)

FORMAT = "fragsearch-index-1"
DB_FILE = "index.sqlite"
LOCK_FILE = ".writer.lock"
FAISS_PREFIX, FAISS_SUFFIX = "faiss", ".index"
STORE_PREFIX, STORE_SUFFIX = "store", ".npy"
MAX_SEGMENTS = 16  # more saved segments than this: the smaller half is merged at the next save
DEAD_SHARE = 0.5  # share of store rows belonging to removed items that triggers a full rewrite
LOAD_ATTEMPTS = 5  # loads of an index that a writer keeps committing to meanwhile
SCAN_ITEMS = 2048  # items per chunk of an exhaustive scan
ADD_ITEMS = 512  # items whose fragments go into FAISS in one call while rebuilding

def built_fingerprint(root: Path) -> str | None:
    """The model fingerprint an index folder was built with; None when it has no readable database."""
    path = Path(root) / DB_FILE
    if not path.is_file():
        return None
    try:
        # immutable: no lock and no -wal/-shm files; the fingerprint is written once, when the index is created
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)) as db:
            row = db.execute("SELECT value FROM info WHERE key = 'fingerprint'").fetchone()
    except sqlite3.DatabaseError:
        return None
    return str(json.loads(row[0])) if row else None


P = TypeVar("P")


class FragmentIndex(Generic[P]):
    """Items (images or sentences), each a few fragment vectors; subclasses define the payload P
    (the item's metadata) and its SQLite columns."""

    KIND: ClassVar[str]
    COLUMNS: ClassVar[tuple[tuple[str, str], ...]]  # (name, SQL type) of the payload columns
    SHARED_FRAGMENTS: ClassVar[bool] = False  # identical vectors go into FAISS once (index.shared)

    def __init__(self, root: Path, bundle: Bundle, settings: IndexSettings, db: sqlite3.Connection) -> None:
        self.root = Path(root)
        self.bundle = bundle
        self.dim = bundle.dim
        self.settings = settings
        self.fingerprint = model_fingerprint(bundle)
        bundle.model.eval()
        self._db = db
        self._reader = sqlite3.connect(self.root / DB_FILE, check_same_thread=False, timeout=30.0)
        self._reader_lock = threading.Lock()
        self._writer = threading.RLock()
        self._rw = ReadWriteLock()
        self.store = VectorStore(self.dim, settings.store_dtype)
        self.ann = AnnIndex(self.dim, settings)
        # per item id: segment (-1 once its rows are dropped), row offset, fragment count, alive
        self._seg = np.zeros(0, np.int32)
        self._off = np.zeros(0, np.int64)
        self._n = np.zeros(0, np.int32)
        self._alive = np.zeros(0, bool)
        self._count = 0
        self._next_id = 0
        self._pending: dict[int, P] = {}  # added since the last save
        self._removed: set[int] = set()  # saved items removed since the last save
        self._generation = 0
        self._ann_file = ""
        self._ann_sha = ""
        self._ann_dirty = True
        self._bulk_depth = 0
        self._unindexed: list[int] = []  # items whose fragments are not in FAISS yet (bulk adds)
        self._extractor: RegionExtractor | None = None
        self._shared = SharedFragments() if self.SHARED_FRAGMENTS else None
        self._extractor_lock = threading.Lock()

    # -- creation and loading -------------------------------------------------------------------------
    @classmethod
    def _create(cls, root: Path, bundle: Bundle, settings: IndexSettings) -> Any:
        root = Path(root)
        if (root / DB_FILE).exists():
            raise FileExistsError(f"an index already exists at {root}: load it, or choose another folder")
        root.mkdir(parents=True, exist_ok=True)
        db = _connect(root / DB_FILE)
        cols = "".join(f", {name} {kind}" for name, kind in cls.COLUMNS)
        with db:
            db.execute("CREATE TABLE info (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.execute(f"CREATE TABLE items (id INTEGER PRIMARY KEY, n INTEGER NOT NULL, seg INTEGER NOT NULL, "
                       f"off INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0{cols})")
            db.executemany("INSERT INTO info VALUES (?, ?)", [
                ("format", json.dumps(FORMAT)), ("kind", json.dumps(cls.KIND)), ("dim", json.dumps(bundle.dim)),
                ("fingerprint", json.dumps(model_fingerprint(bundle))), ("settings", json.dumps(settings.to_dict())),
                ("generation", "0"), ("next_id", "0"), ("segments", "[]"), ("ann_file", '""'),
                ("ann_sha256", '""'), ("ann_trained", "false"), ("ann_ntotal", "0"),
                ("created", json.dumps(time.time())),
            ])
        index = cls(root, bundle, settings, db)
        index.save()
        logger.info("created %s index at %s (%s, h=%d)", cls.KIND, root, settings.kind, bundle.dim)
        return index

    @classmethod
    def _load(cls, root: Path, bundle: Bundle, search: dict[str, Any] | None = None) -> Any:
        """`_load_once`, again when a writer committed and removed files the first snapshot named."""
        for attempt in range(LOAD_ATTEMPTS):
            try:
                return cls._load_once(root, bundle, search)
            except IndexMovedError:
                if attempt == LOAD_ATTEMPTS - 1:
                    raise
                logger.info("index at %s changed while it was being loaded: loading it again", root)
        raise AssertionError("unreachable")

    @classmethod
    def _load_once(cls, root: Path, bundle: Bundle, search: dict[str, Any] | None = None) -> Any:
        root = Path(root)
        path = root / DB_FILE
        if not path.is_file():
            raise IndexLoadError(f"no {cls.KIND} index at {root} ({DB_FILE} is missing); "
                                 f"build one with: python -m index.build")
        try:
            db = _connect(path)
            check = db.execute("PRAGMA quick_check").fetchone()
            if not check or check[0] != "ok":
                raise IndexLoadError(f"{path} is corrupt (SQLite integrity check: {check})")
            db.execute("BEGIN")  # one snapshot for every table read below: a writer may commit meanwhile
            info = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM info")}
        except (sqlite3.DatabaseError, json.JSONDecodeError) as e:
            with contextlib.suppress(NameError, sqlite3.Error):
                db.close()
            raise IndexLoadError(f"{path} is not a readable index database: {e}") from e
        try:
            index = cls._from_info(root, bundle, db, info, search or {})
            db.execute("COMMIT")
        except IndexLoadError as e:
            db.close()
            if _generation(path) != info.get("generation"):  # a newer commit replaced the files it named
                raise IndexMovedError(str(e)) from e
            raise
        except BaseException:
            db.close()
            raise
        logger.info("loaded %s index %s: %d items, %d fragments in FAISS (%s), generation %d", cls.KIND, root,
                    len(index), index.ann.ntotal, index.ann.active_kind, index._generation)
        return index

    @classmethod
    def _from_info(cls, root: Path, bundle: Bundle, db: sqlite3.Connection, info: dict[str, Any],
                   search: dict[str, Any]) -> Any:
        where = f"index at {root}"
        if info.get("format") != FORMAT:
            raise IndexLoadError(f"{where} has format {info.get('format')!r}, expected {FORMAT!r}")
        if info.get("kind") != cls.KIND:
            raise IndexLoadError(f"{where} is an index of {info.get('kind')}s, not of {cls.KIND}s")
        if int(info["dim"]) != bundle.dim:
            raise IndexLoadError(f"{where} holds {info['dim']}-d fragments but the model embeds in {bundle.dim}-d: "
                                 f"it was built with another model; rebuild it with python -m index.build")
        if info["fingerprint"] != model_fingerprint(bundle):
            raise IndexLoadError(f"{where} was built with another model (fingerprint {info['fingerprint']}, this "
                                 f"model {model_fingerprint(bundle)}); rebuild it with python -m index.build")
        try:
            settings = IndexSettings.from_dict(info["settings"])
            if search:
                settings = settings.with_search(**search)
        except (TypeError, ValueError) as e:
            raise IndexLoadError(f"{where}: bad settings: {e}") from e
        index = cls(root, bundle, settings, db)
        index._generation = int(info["generation"])
        index._next_id = int(info["next_id"])
        # store segments
        files, arrays = [], []
        for seg in info["segments"]:
            file, n_rows = str(seg["file"]), int(seg["rows"])
            try:
                arrays.append(VectorStore.open_segment(root / file, bundle.dim, index.store.dtype, n_rows))
            except FileNotFoundError as e:
                raise IndexLoadError(f"{where}: store file {file} is missing") from e
            except (OSError, ValueError) as e:
                raise IndexLoadError(f"{where}: store file {file} is corrupt: {e}") from e
            files.append(file)
        index.store.commit(files, arrays)
        # items
        rows = np.array(db.execute("SELECT id, seg, off, n, deleted FROM items ORDER BY id").fetchall(),
                        dtype=np.int64).reshape(-1, 5)
        index._grow(index._next_id)
        if len(rows):
            if rows[:, 0].max() >= index._next_id:
                raise IndexLoadError(f"{where}: item ids beyond next_id {index._next_id}: inconsistent metadata")
            item = rows[:, 0]
            index._seg[item], index._off[item], index._n[item] = rows[:, 1], rows[:, 2], rows[:, 3]
            index._alive[item] = rows[:, 4] == 0
            live = rows[rows[:, 1] >= 0]
            sizes = np.array(index.store.segment_rows() + [0], dtype=np.int64)
            if len(live) and ((live[:, 1] >= len(arrays)).any() or (live[:, 2] + live[:, 3] > sizes[live[:, 1]]).any()):
                raise IndexLoadError(f"{where}: item rows point outside the store: inconsistent metadata")
            if (rows[rows[:, 4] == 0, 1] < 0).any():
                raise IndexLoadError(f"{where}: a live item has no stored vectors: inconsistent metadata")
        index._count = int(index._alive.sum())
        if index._shared is not None:
            for i in np.flatnonzero(index._alive).tolist():
                index._shared.add(i, index.store.rows(int(index._seg[i]), int(index._off[i]), int(index._n[i])))
        # FAISS
        ann_file = str(info["ann_file"])
        ann_path = root / ann_file
        if not ann_file or not ann_path.is_file():
            raise IndexLoadError(f"{where}: FAISS file {ann_file or '(none)'} is missing")
        if sha256_file(ann_path) != info["ann_sha256"]:
            raise IndexLoadError(f"{where}: FAISS file {ann_file} is corrupt (checksum mismatch)")
        try:
            index.ann = AnnIndex.read(ann_path, bundle.dim, settings, bool(info["ann_trained"]))
        except (RuntimeError, ValueError) as e:
            raise IndexLoadError(f"{where}: FAISS file {ann_file} is unreadable: {e}") from e
        if index.ann.ntotal != int(info["ann_ntotal"]):
            raise IndexLoadError(f"{where}: FAISS file holds {index.ann.ntotal} fragments, metadata says "
                                 f"{info['ann_ntotal']}")
        if index._shared is not None and index.ann.supports_remove and index.ann.ntotal != len(index._shared):
            raise IndexLoadError(f"{where}: FAISS file holds {index.ann.ntotal} fragments, the store "
                                 f"{len(index._shared)} distinct ones")
        index._ann_file, index._ann_sha, index._ann_dirty = ann_file, str(info["ann_sha256"]), False
        return index

    @property
    def extractor(self) -> RegionExtractor:
        """The region extractor of the model's image settings (made on first use unless given)."""
        with self._extractor_lock:
            if self._extractor is None:
                self._extractor = RegionExtractor(self.bundle.image_cfg, str(self.bundle.device))
            return self._extractor

    # -- size and ids ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the database connections (the index is unusable afterwards)."""
        with self._writer:
            self._db.close()
            with self._reader_lock:
                self._reader.close()

    def ids(self) -> np.ndarray:
        """Ids of the live items, ascending."""
        with self._rw.read():
            return np.flatnonzero(self._alive)

    def contains(self, item: int) -> bool:
        return 0 <= item < len(self._alive) and bool(self._alive[item])

    @property
    def n_fragments(self) -> int:
        """Fragments of the live items."""
        with self._rw.read():
            return int(self._n[self._alive].sum())

    @property
    def generation(self) -> int:
        """Number of the last save (increases by one per save)."""
        return self._generation

    def _grow(self, size: int) -> None:
        if size <= len(self._alive):
            return
        cap = max(size, 2 * len(self._alive), 1024)
        for name, fill in (("_seg", -1), ("_off", 0), ("_n", 0), ("_alive", False)):
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    # -- writes ---------------------------------------------------------------------------------------
    def _insert(self, vectors: Sequence[np.ndarray], payloads: Sequence[P]) -> list[int]:
        """Add items: vectors[i] (n_i, dim) float32 are item i's fragments. Returns the new ids."""
        if len(vectors) != len(payloads):
            raise ValueError("one payload per item is needed")
        for v in vectors:
            if v.ndim != 2 or v.shape[1] != self.dim:
                raise ValueError(f"fragments of shape {v.shape}, expected (n, {self.dim})")
            if not 1 <= len(v) <= fid.MAX_FRAGMENTS:
                raise ValueError(f"an item needs 1..{fid.MAX_FRAGMENTS} fragments, got {len(v)}")
        if not vectors:
            return []
        with self._writer:
            first = self._next_id
            new = list(range(first, first + len(vectors)))
            with self._rw.write():
                pairs = list(zip(new, vectors, strict=True))
                if self._shared is not None:  # only vectors not held yet go into FAISS
                    rows = [np.asarray(self._shared.add(i, v.astype(self.store.dtype)), np.int64) for i, v in pairs]
                    faiss_ids = np.concatenate([fid.encode(i, r) for (i, _), r in zip(pairs, rows, strict=True)])
                    flat = np.concatenate([v[r] for (_, v), r in zip(pairs, rows, strict=True)]).astype(np.float32)
                else:
                    faiss_ids = np.concatenate([fid.item_fragments(i, len(v)) for i, v in pairs])
                    flat = np.concatenate(vectors).astype(np.float32, copy=False)
                if self._bulk_depth:
                    self._unindexed.extend(new)
                else:
                    self.ann.add(faiss_ids, flat)
                    self._ann_dirty = True
                self._grow(first + len(vectors))
                for i, v, p in zip(new, vectors, payloads, strict=True):
                    seg, off = self.store.append(v)
                    self._seg[i], self._off[i], self._n[i] = seg, off, len(v)
                    self._pending[i] = p
                self._alive[new] = True
                self._count += len(new)
                self._next_id = first + len(vectors)
            if not self._bulk_depth and self.ann.needs_build(self.ann.ntotal):
                self.rebuild()
        return new

    def remove(self, item: int) -> bool:
        """Remove an item; it is never returned again. False if it is unknown or already removed."""
        with self._writer:
            if not self.contains(item):
                return False
            with self._rw.write():
                self._alive[item] = False
                self._count -= 1
                if self._shared is None:
                    self._ann_dirty |= self.ann.remove_item(item) > 0
                else:  # a vector other items hold stays, under the id of its next holder
                    drop, moved = self._shared.remove(item)
                    self._ann_dirty |= self.ann.remove_ids(drop) > 0
                    waiting = set(self._unindexed)
                    moved = [(o, r) for o, r in moved if o not in waiting]
                    if moved:
                        self.ann.add(*self._rows_of(moved))
                        self._ann_dirty = True
                if item not in self._pending:
                    self._removed.add(item)
            return True

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Defer FAISS inserts while adding many items; on exit the candidate index is built once
        (trained on a sample of everything when its kind needs training). Items added inside are
        reachable by exhaustive search only until the block ends."""
        with self._writer:
            self._bulk_depth += 1
            try:
                yield
            finally:
                self._bulk_depth -= 1
            if self._bulk_depth == 0 and self._unindexed:
                if self.ann.needs_build(self.ann.ntotal + int(self._n[self._unindexed].sum())):
                    self.rebuild()
                else:
                    for start in range(0, len(self._unindexed), ADD_ITEMS):
                        items = np.asarray(self._unindexed[start : start + ADD_ITEMS])
                        ids, vecs = self._entries(items)
                        with self._rw.write():
                            self.ann.add(ids, vecs)
                            self._ann_dirty = True
                self._unindexed = []

    def rebuild(self, settings: IndexSettings | None = None) -> None:
        """Build the candidate index anew from the store, optionally of another kind (`settings`; the
        store precision stays). Trains a trainable kind on a random sample of the stored fragments
        and drops the fragments of removed items that hnsw keeps. Saved by the next save()."""
        with self._writer:
            settings = settings or self.settings
            if settings.store_dtype != self.settings.store_dtype:
                raise ValueError("the store precision cannot change in place: build a new index")
            items = np.flatnonzero(self._alive)
            total = int(self._n[items].sum())
            train = np.zeros((0, self.dim), np.float32)
            ann: AnnIndex | None = None
            if settings.trainable and total < settings.train_threshold():
                ann = AnnIndex(self.dim, settings)  # the flat stand-in until there is enough to train
            elif settings.trainable:
                train = self._sample(items, train_sample_size(settings))
            batches = (self._entries(items[s : s + ADD_ITEMS]) for s in range(0, len(items), ADD_ITEMS))
            if ann is None:
                ann = AnnIndex.build(self.dim, settings, train, batches, total=total)
            else:
                for ids, vecs in batches:
                    ann.add(ids, vecs)
            with self._rw.write():
                self.settings = settings
                self.ann = ann
                self._ann_dirty = True
                self._unindexed = []
            logger.info("%s index %s: candidate index rebuilt (%s, %d fragments)", self.KIND, self.root,
                        ann.active_kind, ann.ntotal)

    def set_search(self, **changes: Any) -> None:
        """Change search-time settings (nprobe, ef_search, k_prime, rerank, use_gpu) without a rebuild."""
        with self._writer:
            settings = self.settings.with_search(**changes)
            with self._rw.write():
                self.settings = settings
                self.ann.set_settings(settings)

    def _entries(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What `items` put into FAISS: fragment ids (N,) and vectors (N, dim) float32 (with shared
        fragments, only the representatives they hold)."""
        if self._shared is None:
            return self._item_vectors(items)
        return self._rows_of(self._shared.representatives(items.tolist()))

    def _rows_of(self, pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(item, row) pairs -> their fragment ids (N,) and stored vectors (N, dim) float32."""
        if not pairs:
            return np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)
        items = np.asarray([i for i, _ in pairs], dtype=np.int64)
        rows = np.asarray([r for _, r in pairs], dtype=np.int64)
        vecs, _ = self.store.gather(self._seg[items], self._off[items] + rows, np.ones(len(items), np.int32))
        return fid.encode(items, rows), vecs[:, 0]

    def _item_vectors(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fragment ids (N,) and vectors (N, dim) float32 of `items`, all their fragments."""
        vecs, mask = self.store.gather(self._seg[items], self._off[items], self._n[items])
        ids = fid.encode(items[:, None], np.arange(vecs.shape[1])[None, :])
        return ids[mask], vecs[mask]

    def _sample(self, items: np.ndarray, size: int) -> np.ndarray:
        """Up to `size` fragment vectors drawn at random from `items`."""
        rng = np.random.default_rng(0)
        total = int(self._n[items].sum())
        if total <= size:
            return self._item_vectors(items)[1]
        per_item = max(1, int(np.ceil(size / max(1, len(items)) )))
        chosen = np.sort(rng.choice(len(items), size=min(len(items), int(np.ceil(size / per_item))), replace=False))
        vecs = self._item_vectors(items[chosen])[1]
        if len(vecs) > size:
            vecs = vecs[np.sort(rng.choice(len(vecs), size=size, replace=False))]
        return vecs

    # -- saving ---------------------------------------------------------------------------------------
    def save(self) -> None:
        """Make the current state durable, atomically (see the module docstring)."""
        with self._writer, self._file_lock():
            if self._bulk_depth:
                raise RuntimeError("save() inside bulk(): leave the bulk block first")
            gen = self._generation + 1
            created: list[Path] = []
            try:
                files, rows = list(self.store.files), self.store.segment_rows()
                seg, off = self._seg.copy(), self._off.copy()
                if self.store.live_rows:
                    name = unique_name(STORE_PREFIX, gen, STORE_SUFFIX)
                    created.append(self.root / name)
                    rows.append(self.store.write_live(self.root / name))
                    files.append(name)
                files, rows = self._compact(gen, files, rows, seg, off, created)
                if self._ann_dirty or not self._ann_file:
                    ann_file = unique_name(FAISS_PREFIX, gen, FAISS_SUFFIX)
                    created.append(self.root / ann_file)
                    with atomic_path(self.root / ann_file) as tmp:
                        self.ann.write(tmp)
                    ann_sha = sha256_file(self.root / ann_file)
                else:
                    ann_file, ann_sha = self._ann_file, self._ann_sha
                self._commit(gen, files, rows, seg, off, ann_file, ann_sha)
            except BaseException as e:
                for path in created:
                    with contextlib.suppress(OSError):
                        path.unlink()
                if _disk_full(e):
                    raise IndexFullError(self.root, e) from e
                raise
            arrays = [self.store.segments[self.store.files.index(f)] if f in self.store.files
                      else VectorStore.open_segment(self.root / f, self.dim, self.store.dtype, r)
                      for f, r in zip(files, rows, strict=True)]
            with self._rw.write():
                self.store.commit(files, arrays)
                self._seg[: len(seg)], self._off[: len(off)] = seg, off
                self._pending.clear()
                self._removed.clear()
                self._generation = gen
                self._ann_file, self._ann_sha, self._ann_dirty = ann_file, ann_sha, False
            self._remove_unreferenced(set(files) | {ann_file})
            with contextlib.suppress(sqlite3.DatabaseError):  # fold the log into the database file
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _compact(self, gen: int, files: list[str], rows: list[int], seg: np.ndarray, off: np.ndarray,
                 created: list[Path]) -> tuple[list[str], list[int]]:
        """Merge segments when there are many or they hold many removed rows. Updates seg/off in place."""
        n_items = self._next_id
        alive = self._alive[:n_items]
        has_rows = seg[:n_items] >= 0
        dead_rows = int(self._n[:n_items][has_rows & ~alive].sum())
        total = sum(rows)
        if total and dead_rows > DEAD_SHARE * total:
            merge = list(range(len(files)))
        elif len(files) > MAX_SEGMENTS:
            merge = sorted(np.argsort(rows, kind="stable")[: len(files) // 2].tolist())
        else:
            return files, rows
        in_merge = np.isin(seg[:n_items], merge)
        moving = np.flatnonzero(in_merge & alive)
        moving = moving[np.lexsort((off[moving], seg[moving]))]
        name = unique_name(STORE_PREFIX, gen, STORE_SUFFIX)
        created.append(self.root / name)
        # rows of the segment just written from the live rows are read from memory (store.rows)
        locs = [(int(seg[i]), int(off[i]), int(self._n[i])) for i in moving]
        new_offsets = self.store.write_items(self.root / name, locs)
        keep = [s for s in range(len(files)) if s not in merge]
        renumber = np.full(len(files), -1, np.int64)
        renumber[keep] = np.arange(len(keep))
        dropped = np.flatnonzero(in_merge & ~alive)
        stay = np.flatnonzero(~in_merge & has_rows)
        seg[stay] = renumber[seg[stay]]
        seg[dropped] = -1
        seg[moving] = len(keep)
        off[moving] = new_offsets
        logger.info("%s index: merged %d store segments (%d rows kept, %d removed rows dropped)", self.KIND,
                    len(merge), sum(n for _, _, n in locs), int(self._n[dropped].sum()))
        return [files[s] for s in keep] + [name], [rows[s] for s in keep] + [sum(n for _, _, n in locs)]

    def _commit(self, gen: int, files: list[str], rows: list[int], seg: np.ndarray, off: np.ndarray,
                ann_file: str, ann_sha: str) -> None:
        """One SQLite transaction: new items, removals, moved rows, and `info` pointing at the new files."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            on_disk = int(json.loads(db.execute("SELECT value FROM info WHERE key='generation'").fetchone()[0]))
            if on_disk != self._generation:
                raise RuntimeError(f"the index at {self.root} was saved by another writer (generation {on_disk}, "
                                   f"this copy has {self._generation}); reload it before writing")
            names = ", ".join(name for name, _ in self.COLUMNS)
            marks = ", ".join("?" for _ in self.COLUMNS)
            db.executemany(
                f"INSERT INTO items (id, n, seg, off, deleted, {names}) VALUES (?, ?, ?, ?, ?, {marks})",
                ((i, int(self._n[i]), int(seg[i]), int(off[i]), int(not self._alive[i]), *self._row(p))
                 for i, p in sorted(self._pending.items())),
            )
            db.executemany("UPDATE items SET deleted = 1 WHERE id = ?", ((i,) for i in sorted(self._removed)))
            moved = np.flatnonzero((seg != self._seg[: len(seg)]) | (off != self._off[: len(off)]))
            db.executemany("UPDATE items SET seg = ?, off = ? WHERE id = ?",
                           ((int(seg[i]), int(off[i]), int(i)) for i in moved if int(i) not in self._pending))
            info = {
                "generation": gen, "next_id": self._next_id, "settings": self.settings.to_dict(),
                "segments": [{"file": f, "rows": r} for f, r in zip(files, rows, strict=True)],
                "ann_file": ann_file, "ann_sha256": ann_sha, "ann_trained": self.ann.trained,
                "ann_ntotal": self.ann.ntotal,
            }
            db.executemany("UPDATE info SET value = ? WHERE key = ?", ((json.dumps(v), k) for k, v in info.items()))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # SQLite may have rolled back already (e.g. SQLITE_FULL)
                db.execute("ROLLBACK")
            raise

    def _remove_unreferenced(self, keep: set[str]) -> None:
        """Delete store / FAISS files and temp files that the committed state does not name."""
        for path in self.root.iterdir():
            name = path.name
            ours = (name.startswith((STORE_PREFIX + "-", FAISS_PREFIX + "-"))
                    or (name.startswith(".") and name.endswith(TMP_SUFFIX)))
            if ours and name not in keep:
                with contextlib.suppress(OSError):
                    path.unlink()
        fsync_dir(self.root)

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """Exclusive lock on the folder across processes while a save runs."""
        with open(self.root / LOCK_FILE, "a+b") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    # -- reads (callers hold self._rw.read()) --------------------------------------------------------
    def _candidates(self, queries: np.ndarray) -> np.ndarray:
        """queries: (t, dim) -> ids of the live items with a fragment among a query's k' nearest
        (k' = 0: every fragment with a positive score).

        With `settings.rerank` = R > 0, only the R items with the best partial score (`_prescore` of
        the sum of max(0, FAISS score) over their retrieved fragments) are kept for the exact re-rank.
        """
        if self.ann.ntotal == 0:
            return np.zeros(0, np.int64)
        if self.settings.k_prime:
            scores, found = self.ann.search(queries, self.settings.k_prime)
            scores, found = scores[found >= 0], found[found >= 0]
        else:
            scores, found = self.ann.search_positive(queries)
        if self._shared is not None:
            items, weights = self._shared.expand(found, scores)
        else:
            items, weights = fid.decode(found)[0], scores
        uniq, where = np.unique(items, return_inverse=True)
        live = self._alive[uniq]
        limit = self.settings.rerank
        if not limit or live.sum() <= limit:
            return uniq[live]
        partial = self._prescore(np.bincount(where, weights=np.maximum(weights, 0), minlength=len(uniq)), uniq)
        partial[~live] = -1.0
        keep = np.lexsort((uniq, -partial))[:limit]  # ties to the smaller id, as the final ranking
        return np.sort(uniq[keep])

    def _prescore(self, partial: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Partial S_kl of candidates from their retrieved fragments: the sum over 1/|g_k| (items are images)."""
        return partial / np.maximum(self._n[items], 1)

    def _candidate_fragments(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Unique live (item, fragment) pairs among each query's k nearest fragments."""
        if self.ann.ntotal == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        _, found = self.ann.search(queries, k)
        uniq = np.unique(found[found >= 0])
        items, frags = fid.decode(uniq)
        keep = self._alive[items]
        return items[keep], frags[keep]

    def _vectors(self, items: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored fragments of `items`: (C, F_max, dim) float32 and mask (C, F_max)."""
        vecs, mask = self.store.gather(self._seg[items], self._off[items], self._n[items])
        return torch.from_numpy(vecs), torch.from_numpy(mask.astype(np.float32))

    def _scan(self, chunk: int = SCAN_ITEMS) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """Every live item in chunks: (ids, vectors (C, F_max, dim), mask (C, F_max))."""
        items = np.flatnonzero(self._alive)
        items = items[np.lexsort((self._off[items], self._seg[items]))]  # file order
        for start in range(0, len(items), chunk):
            part = items[start : start + chunk]
            yield (part, *self._vectors(part))

    def _rank(self, queries: np.ndarray, score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], k: int,
              exhaustive: bool = False) -> list[tuple[int, float, P, torch.Tensor]]:
        """The k best items by `score` of their stored fragments ((C, F, h), mask (C, F) -> (C,)).

        Scored are the FAISS candidates of `queries` (t, h), or every live item when `exhaustive`.
        Returns (item, score, payload, fragments (n, h)) best first, ties to the smaller id.
        """
        with self._rw.read():
            if exhaustive or self._small():
                best: list[tuple[int, float]] = []
                for part, vecs, mask in self._scan():
                    best = merge_top_k(best, part, score(vecs, mask).numpy(), k)
                items = np.asarray([i for i, _ in best], dtype=np.int64)
                vecs, mask = self._vectors(items)
            else:
                return self._top_of(self._candidates(queries), score, k)
            payloads = self._payloads(items.tolist())
        return [(item, s, payloads[item], vecs[row, : int(mask[row].sum())])
                for row, (item, s) in enumerate(best)]

    def _small(self) -> bool:
        """At most `settings.exact_below` live fragments: the exact scan is the cheaper search."""
        limit = self.settings.exact_below
        return bool(limit) and int(np.count_nonzero(self._alive)) <= limit and int(self._n[self._alive].sum()) <= limit

    def _top_of(self, items: np.ndarray, score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], k: int
                ) -> list[tuple[int, float, P, torch.Tensor]]:
        """The k best of candidate `items` by `score` (the exact re-rank), as `_rank` returns them."""
        vecs, mask = self._vectors(items)
        top = top_k(score(vecs, mask).numpy(), items, k)
        keep = np.asarray([pos for pos, _, _ in top], dtype=np.int64)
        vecs, mask, items = vecs[keep], mask[keep], items[keep]
        payloads = self._payloads(items.tolist())
        return [(i, s, payloads[i], vecs[row, : int(mask[row].sum())]) for row, (_, i, s) in enumerate(top)]


    def _rank_many(self, score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n_queries: int, k: int
                   ) -> list[list[tuple[int, float]]]:
        """Exact top k (item, score) of n queries in one pass over the store; `score` maps stored
        fragments ((C, F, h), mask (C, F)) to (C, n_queries) scores."""
        best: list[list[tuple[int, float]]] = [[] for _ in range(n_queries)]
        with self._rw.read():
            for part, vecs, mask in self._scan():
                scores = score(vecs, mask).numpy()
                for q in range(n_queries):
                    best[q] = merge_top_k(best[q], part, scores[:, q], k)
        return best

    def _payloads(self, items: Sequence[int]) -> dict[int, P]:
        """Metadata of items (pending ones from memory, saved ones from SQLite)."""
        out: dict[int, P] = {}
        saved = []
        for i in items:
            p = self._pending.get(int(i))
            if p is not None:
                out[int(i)] = p
            else:
                saved.append(int(i))
        if saved:
            names = ", ".join(name for name, _ in self.COLUMNS)
            marks = ", ".join("?" for _ in saved)
            with self._reader_lock:
                rows = self._reader.execute(f"SELECT id, {names} FROM items WHERE id IN ({marks})", saved).fetchall()
            for row in rows:
                out[int(row[0])] = self._from_row(row[1:])
        return out

    # -- payload <-> SQLite row (subclasses) ----------------------------------------------------------
    def _row(self, payload: P) -> tuple[Any, ...]:
        raise NotImplementedError

    def _from_row(self, row: Sequence[Any]) -> P:
        raise NotImplementedError


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


FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full(e: BaseException) -> bool:
    """A write failed for want of space: ENOSPC / EDQUOT, SQLite's SQLITE_FULL, or FAISS's write error
    (a RuntimeError that carries only the OS's reason as text)."""
    if isinstance(e, OSError):
        return e.errno in FULL
    if isinstance(e, sqlite3.OperationalError):
        return "full" in str(e).lower()
    return isinstance(e, RuntimeError) and any(os.strerror(code) in str(e) for code in FULL)


class IndexMovedError(IndexLoadError):
    """The index was committed anew while it was being loaded (the files a snapshot named are gone)."""


def _generation(path: Path) -> Any:
    """The committed generation in the database at `path` now (None when it cannot be read)."""
    try:
        db = _connect(path)
        try:
            row = db.execute("SELECT value FROM info WHERE key = 'generation'").fetchone()
        finally:
            db.close()
        return None if row is None else json.loads(row[0])
    except (sqlite3.Error, json.JSONDecodeError):
        return None


def _connect(path: Path) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL journal, full fsync."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db

