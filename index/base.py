"""What both indexes share: writes, the save protocol, candidate recall and the exact re-rank.

The parts, one job each:

    index.catalogue   index.sqlite: item rows + the `info` table that names the committed state
    index.items       the item table in memory (store location, fragment count, alive)
    index.store       the re-rank store: fragment vectors read back exactly for S_kl
    index.compaction  merging store segments at a save
    index.candidates  the candidate backend: in-process FAISS (a faiss-*.index file) or Milvus
    index.ranking     top-k with ties to the smaller id

An index folder holds

    index.sqlite          metadata (one row per item) and the `info` table that names the current
                          store segments and candidate state: the commit point of every save
    faiss-*.index         the FAISS candidate index (ids: index.ids), with the FAISS backend
    store-*.npy           fragment vectors for the exact re-rank (memory-mapped)

`save()` writes new files under fresh names (temp file, fsync, rename), makes the candidate state
durable (a new FAISS file; or a Milvus flush), then commits one SQLite transaction that points
`info` at them, then deletes the files (and Milvus collections) no longer named. A crash at any
point before the commit leaves the previous state loadable. A Milvus collection lives outside the
folder and sees writes before they are committed: the first write after a load reconciles it with
the committed state (index.milvus).

Concurrency: searches run under the shared side of a readers-writer lock; writers are serialised
by an RLock, do their slow work (extraction, embedding, file writes) without blocking searches and
take the exclusive side only to mutate in-memory state.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch

from index import ids as fid
from index.candidates import (
    FAISS_PREFIX,
    BackendOptions,
    CandidateBackend,
    Sources,
    create_backend,
    entries_batches,
    open_backend,
)
from index.catalogue import DB_FILE, FORMAT, Catalogue, built_fingerprint, committed_generation
from index.compaction import STORE_PREFIX, STORE_SUFFIX, compact
from index.files import unique_name
from index.fingerprint import model_fingerprint
from index.items import ItemTable
from index.locks import ReadWriteLock
from index.ranking import merge_top_k, top_k
from index.shared import SharedFragments
from index.store import VectorStore
from index.types import IndexFullError, IndexLoadError, IndexSettings
from model.atomic import TMP_SUFFIX, fsync_dir
from model.bundle import Bundle
from model.device import MODEL_DEVICE
from model.image import RegionExtractor

logger = logging.getLogger(__name__)

__all__ = ["DB_FILE", "FragmentIndex", "built_fingerprint"]

LOCK_FILE = ".writer.lock"
LOAD_ATTEMPTS = 5  # loads of an index that a writer keeps committing to meanwhile
SCAN_ITEMS = 2048  # items per chunk of an exhaustive scan
FILTERED_EXACT = 20_000  # a filtered search scores at most this many allowed items exactly, without candidates
ADD_ITEMS = 512  # items whose fragments go into the candidate backend in one call while rebuilding
SAMPLE_SEED = 0
SEARCH_PATHS = ("scan", "candidates")  # how a search found what it ranks (FragmentIndex.searches)

P = TypeVar("P")
Score = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FragmentIndex(Generic[P]):
    """Items (images or sentences), each a few fragment vectors; subclasses define the payload P
    (the item's metadata) and its SQLite columns."""

    KIND: ClassVar[str]
    COLUMNS: ClassVar[tuple[tuple[str, str], ...]]  # (name, SQL type) of the payload columns
    SHARED_FRAGMENTS: ClassVar[bool] = False  # identical vectors go into the backend once (index.shared)

    def __init__(self, root: Path, bundle: Bundle, settings: IndexSettings, catalogue: Catalogue,
                 candidates: CandidateBackend) -> None:
        self.root = Path(root)
        self.bundle = bundle
        self.dim = bundle.dim
        self.settings = settings
        self.fingerprint = model_fingerprint(bundle)
        bundle.model.eval()
        self.catalogue = catalogue
        self.items: ItemTable[P] = ItemTable()
        self.store = VectorStore(self.dim, settings.store_dtype)
        self.candidates = candidates
        self._writer = threading.RLock()
        self._rw = ReadWriteLock()
        self._generation = 0
        self._reconciled = False
        self._bulk_depth = 0
        self._unindexed: list[int] = []  # items whose fragments are not in the backend yet (bulk adds)
        self._replaced: list[CandidateBackend] = []  # backends a rebuild replaced, dropped after the next commit
        self._extractor: RegionExtractor | None = None
        self._shared = SharedFragments() if self.SHARED_FRAGMENTS else None
        self._extractor_lock = threading.Lock()
        self._searches = dict.fromkeys(SEARCH_PATHS, 0)
        self._searches_lock = threading.Lock()

    # -- creation and loading -------------------------------------------------------------------------
    @classmethod
    def _create(cls, root: Path, bundle: Bundle, settings: IndexSettings, backend: BackendOptions | None) -> Any:
        backend = backend or BackendOptions()
        info = {"kind": cls.KIND, "dim": bundle.dim, "fingerprint": model_fingerprint(bundle),
                "settings": settings.to_dict(), "segments": [], "backend": backend.backend}
        catalogue = Catalogue.create(root, cls.COLUMNS, info)
        try:
            candidates = create_backend(Path(root), bundle.dim, settings, backend, cls.KIND)
        except BaseException:
            catalogue.close()
            raise
        index = cls(root, bundle, settings, catalogue, candidates)
        index._reconciled = True
        index.save()
        logger.info("created %s index at %s (%s %s, h=%d)", cls.KIND, root, backend.backend, settings.kind, bundle.dim)
        return index

    @classmethod
    def _load(cls, root: Path, bundle: Bundle, search: dict[str, Any] | None = None,
              backend: BackendOptions | None = None) -> Any:
        """`_load_once`, again when a writer committed and removed files the first snapshot named."""
        for attempt in range(LOAD_ATTEMPTS):
            try:
                return cls._load_once(root, bundle, search, backend)
            except IndexMovedError:
                if attempt == LOAD_ATTEMPTS - 1:
                    raise
                logger.info("index at %s changed while it was being loaded: loading it again", root)
        raise AssertionError("unreachable")

    @classmethod
    def _load_once(cls, root: Path, bundle: Bundle, search: dict[str, Any] | None,
                   backend: BackendOptions | None) -> Any:
        root = Path(root)
        catalogue, info = Catalogue.open_snapshot(root, cls.COLUMNS, cls.KIND)
        try:
            index = cls._from_info(root, bundle, catalogue, info, search or {}, backend)
            catalogue.end_snapshot()
        except IndexLoadError as e:
            catalogue.close()
            if committed_generation(root) != info.get("generation"):  # a newer commit replaced the files it named
                raise IndexMovedError(str(e)) from e
            raise
        except BaseException:
            catalogue.close()
            raise
        logger.info("loaded %s index %s: %d items, %d fragments in %s (%s), generation %d", cls.KIND, root,
                    len(index), index.candidates.ntotal, index.candidates.NAME, index.candidates.active_kind,
                    index._generation)
        return index

    @classmethod
    def _from_info(cls, root: Path, bundle: Bundle, catalogue: Catalogue, info: dict[str, Any],
                   search: dict[str, Any], backend: BackendOptions | None) -> Any:
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
        store = VectorStore(bundle.dim, settings.store_dtype)
        files, arrays = [], []
        for seg in info["segments"]:
            file, n_rows = str(seg["file"]), int(seg["rows"])
            try:
                arrays.append(VectorStore.open_segment(root / file, bundle.dim, store.dtype, n_rows))
            except FileNotFoundError as e:
                raise IndexLoadError(f"{where}: store file {file} is missing") from e
            except (OSError, ValueError) as e:
                raise IndexLoadError(f"{where}: store file {file} is corrupt: {e}") from e
            files.append(file)
        store.commit(files, arrays)
        rows = catalogue.item_rows()
        next_id = int(info["next_id"])
        if len(rows):
            if rows[:, 0].max() >= next_id:
                raise IndexLoadError(f"{where}: item ids beyond next_id {next_id}: inconsistent metadata")
            live = rows[rows[:, 1] >= 0]
            sizes = np.array(store.segment_rows() + [0], dtype=np.int64)
            if len(live) and ((live[:, 1] >= len(arrays)).any() or (live[:, 2] + live[:, 3] > sizes[live[:, 1]]).any()):
                raise IndexLoadError(f"{where}: item rows point outside the store: inconsistent metadata")
            if (rows[rows[:, 4] == 0, 1] < 0).any():
                raise IndexLoadError(f"{where}: a live item has no stored vectors: inconsistent metadata")
        candidates = open_backend(root, bundle.dim, settings, info, backend)
        index = cls(root, bundle, settings, catalogue, candidates)
        index.store = store
        index._generation = int(info["generation"])
        index.items.load(rows, next_id)
        if index._shared is not None:
            for i in index.items.live().tolist():
                index._shared.add(i, index._rows(i))
        if (index._shared is not None and candidates.NAME == "faiss" and candidates.supports_remove
                and candidates.ntotal != len(index._shared)):
            raise IndexLoadError(f"{where}: FAISS file holds {candidates.ntotal} fragments, the store "
                                 f"{len(index._shared)} distinct ones")
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
        return self.items.count

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the database connections and the candidate backend (the index is unusable afterwards)."""
        with self._writer:
            self.catalogue.close()
            self.candidates.close()

    def ids(self) -> np.ndarray:
        """Ids of the live items, ascending."""
        with self._rw.read():
            return self.items.live()

    def contains(self, item: int) -> bool:
        return self.items.contains(item)

    @property
    def n_fragments(self) -> int:
        """Fragments of the live items."""
        with self._rw.read():
            return self.items.fragments()

    @property
    def generation(self) -> int:
        """Number of the last save (increases by one per save)."""
        return self._generation

    @property
    def searches(self) -> dict[str, int]:
        """Searches answered since the index was opened, per path: "scan" (the exact score over every
        live item: a collection under `settings.exact_below` fragments, or an exhaustive search) or
        "candidates" (the backend's recall, then the exact re-rank of what it recalled)."""
        with self._searches_lock:
            return dict(self._searches)

    def _searched(self, path: str) -> None:
        with self._searches_lock:
            self._searches[path] += 1

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the shared side of the lock: the items and the store do not change meanwhile."""
        with self._rw.read():
            yield

    def _rows(self, item: int) -> np.ndarray:
        """(n, dim) stored rows of one item (a view, in the store dtype)."""
        return self.store.rows(int(self.items.seg[item]), int(self.items.off[item]), int(self.items.n[item]))

    # -- writes ---------------------------------------------------------------------------------------
    def _reconcile(self) -> None:
        """Before the first write after a load: the backend holds exactly the committed state."""
        if self._reconciled:
            return
        expected = len(self._shared) if self._shared is not None else self.items.fragments()
        self.candidates.reconcile(self.items.next_id, expected, self._sources(self.items.live()))
        self._reconciled = True

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
            self._reconcile()
            first = self.items.next_id
            new = list(range(first, first + len(vectors)))
            with self._rw.write():
                pairs = list(zip(new, vectors, strict=True))
                if self._shared is not None:  # only vectors not held yet go into the backend
                    rows = [np.asarray(self._shared.add(i, v.astype(self.store.dtype)), np.int64) for i, v in pairs]
                    entry_ids = np.concatenate([fid.encode(i, r) for (i, _), r in zip(pairs, rows, strict=True)])
                    flat = np.concatenate([v[r] for (_, v), r in zip(pairs, rows, strict=True)]).astype(np.float32)
                else:
                    entry_ids = np.concatenate([fid.item_fragments(i, len(v)) for i, v in pairs])
                    flat = np.concatenate(vectors).astype(np.float32, copy=False)
                if self._bulk_depth:
                    self._unindexed.extend(new)
                else:
                    self.candidates.add(entry_ids, flat)
                self.items.grow(first + len(vectors))
                for i, v, p in zip(new, vectors, payloads, strict=True):
                    seg, off = self.store.append(v)
                    self.items.place(i, seg, off, len(v), p)
                self.items.next_id = first + len(vectors)
            if not self._bulk_depth and self.candidates.needs_build(self.candidates.ntotal):
                self.rebuild()
        return new

    def remove(self, item: int) -> bool:
        """Remove an item; it is never returned again. False if it is unknown or already removed."""
        with self._writer:
            if not self.contains(item):
                return False
            self._reconcile()
            with self._rw.write():
                if self._shared is None:
                    self.candidates.remove_item(item)  # first: a backend that refuses it leaves the item live
                else:  # a vector other items hold stays, under the id of its next holder
                    drop, moved = self._shared.remove(item)
                    self.candidates.remove_ids(np.asarray(drop, np.int64))
                    waiting = set(self._unindexed)
                    moved = [(o, r) for o, r in moved if o not in waiting]
                    if moved:
                        self.candidates.add(*self._rows_of(moved))
                self.items.kill(item)
            return True

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Defer backend inserts while adding many items; on exit the candidate index is built once
        (trained on a sample of everything when its kind needs training). Items added inside are
        reachable by exhaustive search only until the block ends."""
        with self._writer:
            self._bulk_depth += 1
            try:
                yield
            finally:
                self._bulk_depth -= 1
            if self._bulk_depth == 0 and self._unindexed:
                waiting = np.asarray(self._unindexed, np.int64)
                if self.candidates.needs_build(self.candidates.ntotal + self.items.fragments(waiting)):
                    self.rebuild()
                else:
                    for ids, vecs in entries_batches(waiting, ADD_ITEMS, self._entries):
                        with self._rw.write():
                            self.candidates.add(ids, vecs)
                self._unindexed = []

    def rebuild(self, settings: IndexSettings | None = None) -> None:
        """Build the candidate index anew from the store, optionally of another kind (`settings`; the
        store precision stays). A trainable kind is trained on a random sample of the stored
        fragments; removed items' fragments that hnsw keeps are dropped. Saved by the next save()."""
        with self._writer:
            self._reconcile()
            settings = settings or self.settings
            if settings.store_dtype != self.settings.store_dtype:
                raise ValueError("the store precision cannot change in place: build a new index")
            built = self.candidates.rebuilt(settings, self._sources(self.items.live()))
            with self._rw.write():
                self.settings = settings
                if built is not self.candidates:
                    self._replaced.append(self.candidates)
                self.candidates = built
                self._unindexed = []
            logger.info("%s index %s: candidate index rebuilt (%s %s, %d fragments)", self.KIND, self.root,
                        built.NAME, built.active_kind, built.ntotal)

    def device_policy(self) -> str:
        """Where each call of this index runs (model.device.placement), as one line for the log."""
        with self._rw.read():
            policy = self.candidates.policy()
            kind = f"{self.candidates.NAME} {self.candidates.active_kind}"
        return f"{self.KIND} index ({kind}): " + ", ".join(
            f"{call} {where}" + (f" ({self.bundle.device})" if where == MODEL_DEVICE else "")
            for call, where in policy.items())

    def set_search(self, **changes: Any) -> None:
        """Change search-time settings (nprobe, ef_search, k_prime, rerank, use_gpu) without a rebuild."""
        with self._writer:
            settings = self.settings.with_search(**changes)
            with self._rw.write():
                self.settings = settings
                self.candidates.set_settings(settings)

    def _sources(self, items: np.ndarray) -> Sources:
        """The entries of `items` for a backend's rebuild or resynchronisation."""
        return Sources(batches=lambda: entries_batches(items, ADD_ITEMS, self._entries),
                       total=self.items.fragments(items), sample=lambda size: self._sample(items, size))

    def _entries(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What `items` put into the backend: fragment ids (N,) and vectors (N, dim) float32 (with
        shared fragments, only the representatives they hold)."""
        if self._shared is None:
            return self._item_vectors(items)
        return self._rows_of(self._shared.representatives(items.tolist()))

    def _rows_of(self, pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(item, row) pairs -> their fragment ids (N,) and stored vectors (N, dim) float32."""
        if not pairs:
            return np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)
        items = np.asarray([i for i, _ in pairs], dtype=np.int64)
        rows = np.asarray([r for _, r in pairs], dtype=np.int64)
        return fid.encode(items, rows), self.fragment_vectors(items, rows)

    def fragment_vectors(self, items: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Stored vectors (N, dim) float32 of fragment `rows` of `items` (each (N,))."""
        vecs, _ = self.store.gather(self.items.seg[items], self.items.off[items] + rows,
                                    np.ones(len(items), np.int32))
        return vecs[:, 0]

    def _item_vectors(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fragment ids (N,) and vectors (N, dim) float32 of `items`, all their fragments."""
        vecs, mask = self.store.gather(self.items.seg[items], self.items.off[items], self.items.n[items])
        ids = fid.encode(items[:, None], np.arange(vecs.shape[1])[None, :])
        return ids[mask], vecs[mask]

    def _sample(self, items: np.ndarray, size: int) -> np.ndarray:
        """Up to `size` fragment vectors drawn at random from `items`."""
        rng = np.random.default_rng(SAMPLE_SEED)
        total = self.items.fragments(items)
        if total <= size:
            return self._item_vectors(items)[1]
        per_item = max(1, int(np.ceil(size / max(1, len(items)))))
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
            self._reconcile()
            gen = self._generation + 1
            created: list[Path] = []
            try:
                files, rows = list(self.store.files), self.store.segment_rows()
                seg, off = self.items.seg.copy(), self.items.off.copy()
                if self.store.live_rows:
                    name = unique_name(STORE_PREFIX, gen, STORE_SUFFIX)
                    created.append(self.root / name)
                    rows.append(self.store.write_live(self.root / name))
                    files.append(name)
                files, rows = compact(self.root, self.store, self.items, gen, files, rows, seg, off, created)
                backend_info = self.candidates.persist(self.root, gen, created)
                self._commit(gen, files, rows, seg, off, backend_info)
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
                self.items.seg[: len(seg)], self.items.off[: len(off)] = seg, off
                self.items.saved()
                self._generation = gen
                self.candidates.committed(backend_info)
            self._remove_unreferenced(set(files) | self.candidates.keeps())
            self.catalogue.checkpoint()

    def _commit(self, gen: int, files: list[str], rows: list[int], seg: np.ndarray, off: np.ndarray,
                backend_info: dict[str, Any]) -> None:
        """One catalogue transaction: new items, removals, moved rows, and `info` naming the new state."""
        items = self.items
        added = ((i, int(items.n[i]), int(seg[i]), int(off[i]), int(not items.alive[i]), *self._row(p))
                 for i, p in sorted(items.pending.items()))
        moved = np.flatnonzero((seg != items.seg[: len(seg)]) | (off != items.off[: len(off)]))
        info = {"generation": gen, "next_id": items.next_id, "settings": self.settings.to_dict(),
                "segments": [{"file": f, "rows": r} for f, r in zip(files, rows, strict=True)], **backend_info}
        self.catalogue.commit(self._generation, added, sorted(items.removed),
                              ((int(seg[i]), int(off[i]), int(i)) for i in moved if int(i) not in items.pending), info)

    def _remove_unreferenced(self, keep: set[str]) -> None:
        """Delete store / FAISS files and temp files that the committed state does not name, and the
        backends a rebuild replaced."""
        for path in self.root.iterdir():
            name = path.name
            ours = (name.startswith((STORE_PREFIX + "-", FAISS_PREFIX + "-"))
                    or (name.startswith(".") and name.endswith(TMP_SUFFIX)))
            if ours and name not in keep:
                with contextlib.suppress(OSError):
                    path.unlink()
        fsync_dir(self.root)
        replaced, self._replaced = self._replaced, []
        for old in replaced:
            old.discard()
        self.candidates.drop_unreferenced()

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
    def _candidates(self, queries: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        """queries: (t, dim) -> ids of the live items with a fragment among a query's k' nearest
        (k' = 0: every fragment with a positive score); with `allowed` (sorted ids), only those items:
        a backend that filters while it searches (Milvus) is given them, the others' results are
        filtered after.

        With `settings.rerank` = R > 0, only the R items with the best partial score (`_prescore` of
        the sum of max(0, backend score) over their retrieved fragments) are kept for the exact re-rank.
        """
        self._searched("candidates")
        if self.candidates.ntotal == 0 or (allowed is not None and not len(allowed)):
            return np.zeros(0, np.int64)
        only = {} if allowed is None or self._shared is not None else {"items": allowed}
        if self.settings.k_prime:
            search = self.candidates.search if self._shared is not None else self.candidates.search_items
            scores, found = search(queries, self.settings.k_prime, **only)
            scores, found = scores[found >= 0], found[found >= 0]
        else:
            scores, found = self.candidates.search_positive(queries, **only)
        if self._shared is not None:
            items, weights = self._shared.expand(found, scores)
        else:
            items, weights = fid.decode(found)[0], scores
        uniq, where = np.unique(items, return_inverse=True)
        live = self.items.live_among(uniq)
        if allowed is not None:
            live &= np.isin(uniq, allowed, assume_unique=True)
        limit = self.settings.rerank
        if not limit or live.sum() <= limit:
            return uniq[live]
        partial = self._prescore(np.bincount(where, weights=np.maximum(weights, 0), minlength=len(uniq)),
                                 np.where(live, uniq, 0))
        partial[~live] = -1.0
        keep = np.lexsort((uniq, -partial))[:limit]  # ties to the smaller id, as the final ranking
        return np.sort(uniq[keep])

    def _prescore(self, partial: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Partial S_kl of candidates from their retrieved fragments: the sum over 1/|g_k| (items are images)."""
        return partial / np.maximum(self.items.n[items], 1)

    def candidate_fragments(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Unique live (item, fragment) pairs among each query's k nearest fragments (caller holds `reading`)."""
        self._searched("candidates")
        if self.candidates.ntotal == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        _, found = self.candidates.search(queries, k)
        uniq = np.unique(found[found >= 0])
        items, frags = fid.decode(uniq)
        keep = self.items.live_among(items)
        return items[keep], frags[keep]

    def _vectors(self, items: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored fragments of `items`: (C, F_max, dim) float32 and mask (C, F_max)."""
        vecs, mask = self.store.gather(self.items.seg[items], self.items.off[items], self.items.n[items])
        return torch.from_numpy(vecs), torch.from_numpy(mask.astype(np.float32))

    def _scan(self, chunk: int = SCAN_ITEMS, items: np.ndarray | None = None
              ) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """Every live item (or the live `items` given) in chunks: (ids, vectors (C, F_max, dim), mask (C, F_max))."""
        self._searched("scan")
        items = self.items.live() if items is None else items
        items = items[np.lexsort((self.items.off[items], self.items.seg[items]))]  # file order
        for start in range(0, len(items), chunk):
            part = items[start : start + chunk]
            yield (part, *self._vectors(part))

    def _rank(self, queries: np.ndarray, score: Score, k: int, exhaustive: bool = False
              ) -> list[tuple[int, float, P, torch.Tensor]]:
        """The k best items by `score` of their stored fragments ((C, F, h), mask (C, F) -> (C,)).

        Scored are the backend's candidates of `queries` (t, h), or every live item when `exhaustive`.
        Returns (item, score, payload, fragments (n, h)) best first, ties to the smaller id.
        """
        return self._ranked(queries, score, k, exhaustive)[0]

    def _ranked(self, queries: np.ndarray, score: Score, k: int, exhaustive: bool = False,
                allowed: np.ndarray | None = None) -> tuple[list[tuple[int, float, P, torch.Tensor]], int]:
        """`_rank`, and how many items the exact score ranked (the candidates, or every live item).
        `allowed` (sorted ids) limits the ranking to those items: all of them scored exactly when they
        are at most `FILTERED_EXACT` (or the collection is scanned anyway), else their candidates."""
        with self._rw.read():
            if allowed is not None:
                allowed = allowed[self.items.live_among(allowed)] if len(allowed) else allowed
            if allowed is not None and not (exhaustive or self._small() or len(allowed) <= FILTERED_EXACT):
                candidates = self._candidates(queries, allowed)
                return self._top_of(candidates, score, k), len(candidates)
            if exhaustive or self._small() or allowed is not None:
                best: list[tuple[int, float]] = []
                considered = 0
                for part, vecs, mask in self._scan(items=allowed):
                    best = merge_top_k(best, part, score(vecs, mask).numpy(), k)
                    considered += len(part)
                items = np.asarray([i for i, _ in best], dtype=np.int64)
                vecs, mask = self._vectors(items)
            else:
                candidates = self._candidates(queries)
                return self._top_of(candidates, score, k), len(candidates)
            payloads = self.payloads(items.tolist())
        return [(item, s, payloads[item], vecs[row, : int(mask[row].sum())])
                for row, (item, s) in enumerate(best)], considered

    def _small(self) -> bool:
        """At most `settings.exact_below` live fragments: the exact scan is the cheaper search."""
        limit = self.settings.exact_below
        return bool(limit) and self.items.count <= limit and self.items.fragments() <= limit

    def _top_of(self, items: np.ndarray, score: Score, k: int) -> list[tuple[int, float, P, torch.Tensor]]:
        """The k best of candidate `items` by `score` (the exact re-rank), as `_rank` returns them."""
        vecs, mask = self._vectors(items)
        top = top_k(score(vecs, mask).numpy(), items, k)
        keep = np.asarray([pos for pos, _, _ in top], dtype=np.int64)
        vecs, mask, items = vecs[keep], mask[keep], items[keep]
        payloads = self.payloads(items.tolist())
        return [(i, s, payloads[i], vecs[row, : int(mask[row].sum())]) for row, (_, i, s) in enumerate(top)]

    def _rank_many(self, score: Score, n_queries: int, k: int) -> list[list[tuple[int, float]]]:
        """Exact top k (item, score) of n queries in one pass over the store; `score` maps stored
        fragments ((C, F, h), mask (C, F)) to (C, n_queries) scores."""
        best: list[list[tuple[int, float]]] = [[] for _ in range(n_queries)]
        with self._rw.read():
            for part, vecs, mask in self._scan():
                scores = score(vecs, mask).numpy()
                for q in range(n_queries):
                    best[q] = merge_top_k(best[q], part, scores[:, q], k)
        return best

    def payloads(self, items: Sequence[int]) -> dict[int, P]:
        """Metadata of items (pending ones from memory, saved ones from the catalogue)."""
        out: dict[int, P] = {}
        saved = []
        for i in items:
            p = self.items.pending.get(int(i))
            if p is not None:
                out[int(i)] = p
            else:
                saved.append(int(i))
        if saved:
            for row in self.catalogue.payload_rows(saved):
                out[int(row[0])] = self._from_row(row[1:])
        return out

    # -- payload <-> SQLite row (subclasses) ----------------------------------------------------------
    def _row(self, payload: P) -> tuple[Any, ...]:
        raise NotImplementedError

    def _from_row(self, row: Sequence[Any]) -> P:
        raise NotImplementedError


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
