"""An index of items (images or sentences), each a few fragment vectors: its state and its writes.

`FragmentIndex` is composed of parts that each read alone:

    index.loading     opening a saved folder: the catalogue snapshot and every check of it
    index.saving      the save: new files, one commit transaction, clean-up (the commit protocol)
    index.ranker      the reads: candidates -> prescore -> exact re-rank -> payloads
    index.stored      the stored fragments of items (re-rank batches, backend entries, samples)
    index.backends    the candidate backend an index uses (index.ann, index.milvus;
                      their interface is index.candidates)
    index.catalogue   index.sqlite: item rows + the `info` table that names the committed state
    index.items       the item table in memory (store location, fragment count, alive)
    index.store       the re-rank store: fragment vectors read back exactly for S_kl
    index.codes       the prescore codes of the stored fragments (approximate scores of many candidates)
    index.shared      identical fragment vectors held once in the backend (the sentence side)

Here are the writes (insert, remove, bulk, rebuild) and the state the parts share. Writes change the
in-memory state and the candidate backend; `save()` makes them durable (index.saving).

Concurrency: searches run under the shared side of a readers-writer lock (`rw`); writers are
serialised by an RLock (`writer`), do their slow work (extraction, embedding, file writes) without
blocking searches and take the exclusive side only to mutate in-memory state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from fragsearch.index import ids as fid
from fragsearch.index import loading, saving
from fragsearch.index.backends import create_backend
from fragsearch.index.candidates import CandidateBackend
from fragsearch.index.catalogue import Catalogue, built_fingerprint
from fragsearch.index.codes import PrescoreCodes
from fragsearch.index.fingerprint import model_fingerprint
from fragsearch.index.items import ItemTable
from fragsearch.index.locks import ReadWriteLock
from fragsearch.index.ranker import Ranker
from fragsearch.index.shared import SharedFragments
from fragsearch.index.store import VectorStore
from fragsearch.index.stored import StoredFragments
from fragsearch.index.types import BackendOptions, IndexLoadError, IndexSettings
from fragsearch.model.bundle import Bundle

logger = logging.getLogger(__name__)

__all__ = ["FragmentIndex", "built_fingerprint"]

P = TypeVar("P")


class FragmentIndex(Generic[P]):
    """Items (images or sentences), each a few fragment vectors; subclasses define the payload P
    (the item's metadata) and its SQLite columns."""

    KIND: ClassVar[str]
    COLUMNS: ClassVar[tuple[tuple[str, str], ...]]  # (name, SQL type) of the payload columns
    SHARED_FRAGMENTS: ClassVar[bool] = False  # identical vectors go into the backend once (index.shared)
    PRESCORE_SMOOTHING: ClassVar[float] = 0.0  # the n of a candidate's partial S_kl (index.ranker)

    def __init__(self, root: Path, bundle: Bundle, settings: IndexSettings, catalogue: Catalogue,
                 candidates: CandidateBackend, store: VectorStore | None = None, generation: int = 0,
                 codes: PrescoreCodes | None = None) -> None:
        self.root = Path(root)
        self.bundle = bundle
        self.dim = bundle.dim
        self.settings = settings
        self.fingerprint = model_fingerprint(bundle)
        self.catalogue = catalogue
        self.items: ItemTable[P] = ItemTable()
        self.store = store or VectorStore(self.dim, settings.shape.store_dtype, self.root)  # spills into the folder
        self.candidates = candidates
        self.codes = codes  # the committed prescore codes (index.codes), None without `settings.shape.codes`
        self.generation = generation  # number of the last save (increases by one per save)
        self.writer = threading.RLock()
        self.rw = ReadWriteLock()
        self.reconciled = False
        self.bulk_depth = 0
        self.unindexed: list[int] = []  # items whose fragments are not in the backend yet (bulk adds)
        self.replaced: list[CandidateBackend] = []  # backends a rebuild replaced, dropped after the next commit
        self.shared = SharedFragments() if self.SHARED_FRAGMENTS else None
        self.stored = StoredFragments(self.items, self.store, self.shared)
        self.ranker: Ranker[P] = Ranker(self)

    # -- creation and loading -------------------------------------------------------------------------
    @staticmethod
    def _servable(bundle: Bundle) -> None:
        """ValueError for a model whose S_kl the index's re-rank does not compute: one pooling over ranks
        (ModelConfig.pool_ranks: its candidates are scored item by item, without the image's ranked
        fragments)."""
        if bundle.pool is not None:
            raise ValueError("a model whose S_kl pools over ranks (pool_ranks > 0) is evaluated, not indexed: "
                             "serve a model with the mean's S_kl")

    @classmethod
    def _create(cls, root: Path, bundle: Bundle, settings: IndexSettings, backend: BackendOptions | None) -> Any:
        cls._servable(bundle)
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
        index.reconciled = True
        index.save()
        logger.info("created %s index at %s (%s %s, h=%d)", cls.KIND, root, backend.backend, settings.shape.kind,
                    bundle.dim)
        return index

    @classmethod
    def _load(cls, root: Path, bundle: Bundle, search: dict[str, Any] | None = None,
              backend: BackendOptions | None = None) -> Any:
        """The index saved at `root` (index.loading), its items and shared fragments in memory."""
        cls._servable(bundle)
        index = loading.load(root, bundle, cls.KIND, cls.COLUMNS, search, backend,
                             lambda opened: cls._from_opened(bundle, opened))
        index.summarise()
        logger.info("loaded %s index %s: %d items, %d fragments in %s (%s), generation %d", cls.KIND, root,
                    len(index), index.candidates.ntotal, index.candidates.NAME, index.candidates.active_kind,
                    index.generation)
        return index

    @classmethod
    def _from_opened(cls, bundle: Bundle, opened: loading.Opened) -> Any:
        index = cls(opened.root, bundle, opened.settings, opened.catalogue, opened.candidates, opened.store,
                    opened.generation, opened.codes)
        index.items.load(opened.rows, opened.next_id)
        candidates, shared = index.candidates, index.shared
        if shared is not None:
            for i in index.items.live().tolist():
                shared.add(i, index.stored.rows(i))
            index.store.release_all()  # the pass read every stored row: none of them stays resident
            if candidates.NAME == "faiss" and candidates.supports_remove and candidates.ntotal != len(shared):
                raise IndexLoadError(f"index at {opened.root}: FAISS file holds {candidates.ntotal} fragments, "
                                     f"the store {len(shared)} distinct ones")
        return index

    # -- size and ids ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.items.count

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the database connections and the candidate backend (the index is unusable afterwards)."""
        with self.writer:
            self.catalogue.close()
            self.candidates.close()
            self.store.close()

    def ids(self) -> np.ndarray:
        """Ids of the live items, ascending."""
        with self.rw.read():
            return self.items.live()

    def contains(self, item: int) -> bool:
        return self.items.contains(item)

    @property
    def n_fragments(self) -> int:
        """Fragments of the live items."""
        with self.rw.read():
            return self.items.fragments()

    @property
    def searches(self) -> dict[str, int]:
        """Searches answered since the index was opened, per path (index.ranker.Ranker.searches)."""
        return self.ranker.searches

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the shared side of the lock: the items and the store do not change meanwhile."""
        with self.rw.read():
            yield

    # -- writes ---------------------------------------------------------------------------------------
    def reconcile(self) -> None:
        """Before the first write after a load: the backend holds exactly the committed state."""
        if self.reconciled:
            return
        expected = len(self.shared) if self.shared is not None else self.items.fragments()
        self.candidates.reconcile(self.items.next_id, expected, self.stored.sources(self.items.live()))
        self.reconciled = True

    def insert(self, vectors: Sequence[np.ndarray], payloads: Sequence[P]) -> list[int]:
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
        with self.writer:
            self.reconcile()
            first = self.items.next_id
            new = list(range(first, first + len(vectors)))
            with self.rw.write():
                pairs = list(zip(new, vectors, strict=True))
                if self.shared is not None:  # only vectors not held yet go into the backend
                    rows = [np.asarray(self.shared.add(i, v.astype(self.store.dtype)), np.int64) for i, v in pairs]
                    entry_ids = np.concatenate([fid.encode(i, r) for (i, _), r in zip(pairs, rows, strict=True)])
                    flat = np.concatenate([v[r] for (_, v), r in zip(pairs, rows, strict=True)]).astype(np.float32)
                else:
                    entry_ids = np.concatenate([fid.item_fragments(i, len(v)) for i, v in pairs])
                    flat = np.concatenate(vectors).astype(np.float32, copy=False)
                if self.bulk_depth:
                    self.unindexed.extend(new)
                else:
                    self.candidates.add(entry_ids, flat)
                self.items.grow(first + len(vectors))
                for i, v, p in zip(new, vectors, payloads, strict=True):
                    seg, off = self.store.append(v)
                    self.items.place(i, seg, off, len(v), p)
                self.items.next_id = first + len(vectors)
            if not self.bulk_depth and self.candidates.needs_build(self.candidates.ntotal):
                self.rebuild()
        return new

    def remove(self, item: int) -> bool:
        """Remove an item; it is never returned again. False if it is unknown or already removed."""
        with self.writer:
            if not self.contains(item):
                return False
            self.reconcile()
            with self.rw.write():
                if self.shared is None:
                    self.candidates.remove_item(item)  # first: a backend that refuses it leaves the item live
                else:  # a vector other items hold stays, under the id of its next holder
                    drop, moved = self.shared.remove(item)
                    self.candidates.remove_ids(np.asarray(drop, np.int64))
                    waiting = set(self.unindexed)
                    moved = [(o, r) for o, r in moved if o not in waiting]
                    if moved:
                        self.candidates.add(*self.stored.rows_of(moved))
                self.items.kill(item)
            return True

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Defer backend inserts while adding many items; on exit the candidate index is built once
        (trained on a sample of everything when its kind needs training). Items added inside are
        reachable by exhaustive search only until the block ends."""
        with self.writer:
            self.bulk_depth += 1
            try:
                yield
            finally:
                self.bulk_depth -= 1
            if self.bulk_depth == 0 and self.unindexed:
                waiting = np.asarray(self.unindexed, np.int64)
                if self.candidates.needs_build(self.candidates.ntotal + self.items.fragments(waiting)):
                    self.rebuild()
                else:
                    for ids, vecs in self.stored.batches(waiting):
                        with self.rw.write():
                            self.candidates.add(ids, vecs)
                self.unindexed = []

    def rebuild(self, settings: IndexSettings | None = None) -> None:
        """Build the candidate index anew from the store, optionally of another kind (`settings`; the
        store precision stays). A trainable kind is trained on a random sample of the stored
        fragments; removed items' fragments that hnsw keeps are dropped. Saved by the next save()."""
        with self.writer:
            self.reconcile()
            settings = settings or self.settings
            if settings.shape.store_dtype != self.settings.shape.store_dtype:
                raise ValueError("the store precision cannot change in place: build a new index")
            built = self.candidates.rebuilt(settings, self.stored.sources(self.items.live()))
            with self.rw.write():
                self.settings = settings
                if built is not self.candidates:
                    self.replaced.append(self.candidates)
                self.candidates = built
                self.unindexed = []
            logger.info("%s index %s: candidate index rebuilt (%s %s, %d fragments)", self.KIND, self.root,
                        built.NAME, built.active_kind, built.ntotal)

    def device_policy(self) -> str:
        """Where each call of this index runs (model.device.placement), as one line for the log."""
        with self.rw.read():
            policy = self.candidates.policy()
            kind = f"{self.candidates.NAME} {self.candidates.active_kind}"
        return f"{self.KIND} index ({kind}): " + ", ".join(
            f"{call} {where}" for call, where in policy.items())

    def set_search(self, **changes: Any) -> None:
        """Change search-time settings (nprobe, ef_search, k_prime, rerank, use_gpu) without a rebuild."""
        with self.writer:
            settings = self.settings.with_search(**changes)
            with self.rw.write():
                self.settings = settings
                self.candidates.set_settings(settings)
            self.summarise()

    def save(self) -> None:
        """Make the current state durable, atomically (index.saving)."""
        with self.writer:  # the summaries of the committed codes, before another write changes the items
            saving.save(self)
            self.summarise()

    def summarise(self) -> None:
        """With `settings.search.summaries`, the items' summaries of the code files that have none yet
        (index.codes), computed now (a load, a save, the setting turned on) rather than in a search."""
        if self.settings.search.summaries and self.codes is not None:
            started = time.perf_counter()
            self.codes.summaries(self.items)
            logger.info("item summaries of %d items in %.1f s", len(self), time.perf_counter() - started)

    def add_codes(self, dim: int, refine: int = 0) -> None:
        """Keep `dim`-dimensional prescore codes of the stored fragments (index.codes; 0: none) and
        `refine`-dimensional refining codes (0: none), and save: the save derives the codes of every
        stored segment, in the commit (a crash keeps the last committed state). A load of an index
        with codes derives those of new rows at each save."""
        with self.writer:
            settings = self.settings.with_shape(codes=dim, refine_codes=refine if dim else 0)
            with self.rw.write():
                self.settings = settings
            self.save()

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
                out[int(row[0])] = self.from_row(row[1:])
        return out

    # -- payload <-> SQLite row (subclasses) ----------------------------------------------------------
    def row(self, payload: P) -> tuple[Any, ...]:
        raise NotImplementedError

    def from_row(self, row: Sequence[Any]) -> P:
        raise NotImplementedError
