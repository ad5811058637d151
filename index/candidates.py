"""Candidate backends: where the fragment vectors are searched for candidates (the exact S_kl
re-rank then reads the re-rank store, index.store, and calls model.score on both backends).

`CandidateBackend` is the interface `index.base.FragmentIndex` uses; `FaissCandidates` is the
in-process FAISS index saved as a `faiss-*.index` file beside the catalogue (the embedded default),
`index.milvus.MilvusCandidates` a Milvus collection (milvus-lite in a local folder, or a Milvus
server or cluster by URI). Ids are `index.ids` fragment ids (item · 2^10 + row).

Persistence follows the index's commit protocol (index.base): `persist` prepares what the next
commit names (a new FAISS file, or the Milvus collection flushed), the catalogue commit makes it
current, `committed` adopts it, and whatever the commit no longer names is dropped afterwards.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from index.ann import AnnIndex, train_sample_size
from index.files import sha256_file, unique_name
from index.types import IndexLoadError, IndexSettings
from model.atomic import atomic_path
from model.device import MODEL_DEVICE

logger = logging.getLogger(__name__)

BACKENDS = ("faiss", "milvus")
FAISS_PREFIX, FAISS_SUFFIX = "faiss", ".index"

Batches = Iterable[tuple[np.ndarray, np.ndarray]]  # (fragment ids (N,), vectors (N, dim) float32)


@dataclass(frozen=True)
class BackendOptions:
    """Where a backend keeps its vectors: `backend` "faiss" or "milvus"; `uri` of a Milvus server
    ("http://host:19530") or a milvus-lite folder ("path/file.db"); None: the index's default (for
    Milvus, the URI it was built with, or `milvus.db` inside the index folder)."""

    backend: str = "faiss"
    uri: str | None = None
    token: str | None = None  # a Milvus server's credentials ("user:password" or an API key)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")


@dataclass
class Sources:
    """What a backend may need from the index to rebuild or resynchronise itself: the entries of every
    live item in batches, their count, and a random sample of stored vectors of a given size."""

    batches: Callable[[], Batches]
    total: int
    sample: Callable[[int], np.ndarray]


class CandidateBackend(ABC):
    """Inner-product candidate search over fragment vectors, kept in step with the index's writes."""

    NAME: ClassVar[str]
    settings: IndexSettings

    # -- state ------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def ntotal(self) -> int:
        """Fragment vectors held."""

    @property
    @abstractmethod
    def active_kind(self) -> str:
        """The kind searched now (a trainable kind runs as "flat" until it is built)."""

    @property
    @abstractmethod
    def trained(self) -> bool:
        """The target kind is built (not a flat stand-in)."""

    @property
    @abstractmethod
    def supports_remove(self) -> bool:
        """Removed fragments leave the backend (else the caller filters them)."""

    def needs_build(self, n_vectors: int) -> bool:
        """True when a flat stand-in holds enough vectors to build the target kind."""
        return False

    @abstractmethod
    def set_settings(self, settings: IndexSettings) -> None:
        """New search-time settings (the stored structure stays)."""

    # -- writes -----------------------------------------------------------------------------------
    @abstractmethod
    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """ids: (n,) int64 fragment ids; vecs: (n, dim) float32."""

    @abstractmethod
    def remove_item(self, item: int) -> int:
        """Remove every fragment of `item`; how many were removed (0 where unsupported)."""

    @abstractmethod
    def remove_ids(self, ids: np.ndarray) -> int:
        """Remove fragments by id; how many were removed (0 where unsupported)."""

    @abstractmethod
    def rebuilt(self, settings: IndexSettings, sources: Sources) -> CandidateBackend:
        """A backend of `settings` holding the entries of `sources` (the current one stays usable
        until the caller switches to the new one and the next commit names it)."""

    def reconcile(self, next_id: int, expected: int, sources: Sources) -> None:  # noqa: B027 (optional hook)
        """Before the first write: make the backend hold exactly the committed state (a backend
        outside the index folder may hold writes of a process that died before its commit)."""

    # -- search -----------------------------------------------------------------------------------
    # `items` (sorted ids): only fragments of these items are wanted. A backend that can filter while it
    # searches (Milvus: a filter expression) does; the others ignore it and the caller filters after.
    @abstractmethod
    def search(self, queries: np.ndarray, k: int, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """queries (t, dim) float32 -> scores (t, k), fragment ids (t, k) of the k nearest fragments
        (-1 where fewer exist)."""

    def search_items(self, queries: np.ndarray, k: int, items: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Candidate recall: (t, k) scores and fragment ids of fragments near each query, at most k per
        query; a backend may return one fragment per item (its best) to reach k distinct items."""
        return self.search(queries, k, items)

    @abstractmethod
    def search_positive(self, queries: np.ndarray, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Fragments with a positive score for some query: scores (N,), fragment ids (N,), to be summed
        per fragment (a fragment may come once per query)."""

    def policy(self) -> dict[str, str]:
        """Where each call runs (model.device.CALLS -> a placement); a backend outside the process
        searches and writes where it lives, the exact score runs on the model's device."""
        return {"knn": self.NAME, "range": self.NAME, "exact": MODEL_DEVICE, "write": self.NAME}

    # -- persistence ------------------------------------------------------------------------------
    @abstractmethod
    def persist(self, root: Path, generation: int, created: list[Path]) -> dict[str, Any]:
        """Make the current state durable for the commit of `generation`: the `info` entries that
        name it. New files go to `created` (deleted by the caller when the commit fails)."""

    @abstractmethod
    def committed(self, info: dict[str, Any]) -> None:
        """The commit that names `info` (from `persist`) succeeded."""

    @abstractmethod
    def keeps(self) -> set[str]:
        """Files of the index folder this backend's committed state needs."""

    def drop_unreferenced(self) -> None:  # noqa: B027 (optional hook)
        """Drop state outside the index folder that no commit names (after a commit)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections (the backend is unusable afterwards)."""

    def discard(self) -> None:
        """Drop the state of a backend a rebuild replaced, then close it."""
        self.close()


class FaissCandidates(CandidateBackend):
    """The in-process FAISS index (index.ann), saved as a file of the index folder."""

    NAME = "faiss"

    def __init__(self, ann: AnnIndex, file: str = "", sha: str = "") -> None:
        self.ann = ann
        self.settings = ann.settings
        self._file, self._sha = file, sha
        self._dirty = not file

    @classmethod
    def create(cls, dim: int, settings: IndexSettings) -> FaissCandidates:
        return cls(AnnIndex(dim, settings))

    @classmethod
    def open(cls, root: Path, dim: int, settings: IndexSettings, info: dict[str, Any]) -> FaissCandidates:
        where = f"index at {root}"
        file = str(info.get("ann_file", ""))
        path = Path(root) / file
        if not file or not path.is_file():
            raise IndexLoadError(f"{where}: FAISS file {file or '(none)'} is missing")
        if sha256_file(path) != info.get("ann_sha256"):
            raise IndexLoadError(f"{where}: FAISS file {file} is corrupt (checksum mismatch)")
        try:
            ann = AnnIndex.read(path, dim, settings, bool(info["ann_trained"]))
        except (RuntimeError, ValueError) as e:
            raise IndexLoadError(f"{where}: FAISS file {file} is unreadable: {e}") from e
        if ann.ntotal != int(info["ann_ntotal"]):
            raise IndexLoadError(f"{where}: FAISS file holds {ann.ntotal} fragments, metadata says "
                                 f"{info['ann_ntotal']}")
        return cls(ann, file, str(info["ann_sha256"]))

    # -- state ------------------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return self.ann.ntotal

    @property
    def active_kind(self) -> str:
        return self.ann.active_kind

    @property
    def trained(self) -> bool:
        return self.ann.trained

    @property
    def supports_remove(self) -> bool:
        return self.ann.supports_remove

    def needs_build(self, n_vectors: int) -> bool:
        return self.ann.needs_build(n_vectors)

    def set_settings(self, settings: IndexSettings) -> None:
        self.settings = settings
        self.ann.set_settings(settings)

    # -- writes -----------------------------------------------------------------------------------
    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        if len(ids):
            self.ann.add(ids, vecs)
            self._dirty = True

    def remove_item(self, item: int) -> int:
        n = self.ann.remove_item(item)
        self._dirty |= n > 0
        return n

    def remove_ids(self, ids: np.ndarray) -> int:
        n = self.ann.remove_ids(ids)
        self._dirty |= n > 0
        return n

    def rebuilt(self, settings: IndexSettings, sources: Sources) -> FaissCandidates:
        """Trains a trainable kind on a random sample of the stored fragments (a flat stand-in while
        there are too few); drops the fragments of removed items that hnsw keeps."""
        dim = self.ann.dim
        if settings.trainable and sources.total < settings.train_threshold():
            ann = AnnIndex(dim, settings)  # the flat stand-in until there is enough to train
            for ids, vecs in sources.batches():
                ann.add(ids, vecs)
        else:
            train = sources.sample(train_sample_size(settings)) if settings.trainable else np.zeros((0, dim))
            ann = AnnIndex.build(dim, settings, train.astype(np.float32), sources.batches(), total=sources.total)
        return FaissCandidates(ann)

    # -- search -----------------------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.ann.search(queries, k)  # `items` is filtered by the caller

    def search_positive(self, queries: np.ndarray, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.ann.search_positive(queries)

    def policy(self) -> dict[str, str]:
        return self.ann.policy()

    # -- persistence ------------------------------------------------------------------------------
    def persist(self, root: Path, generation: int, created: list[Path]) -> dict[str, Any]:
        file, sha = self._file, self._sha
        if self._dirty or not file:
            file = unique_name(FAISS_PREFIX, generation, FAISS_SUFFIX)
            created.append(Path(root) / file)
            with atomic_path(Path(root) / file) as tmp:
                self.ann.write(tmp)
            sha = sha256_file(Path(root) / file)
        return {"backend": self.NAME, "ann_file": file, "ann_sha256": sha, "ann_trained": self.ann.trained,
                "ann_ntotal": self.ann.ntotal}

    def committed(self, info: dict[str, Any]) -> None:
        self._file, self._sha, self._dirty = str(info["ann_file"]), str(info["ann_sha256"]), False

    def keeps(self) -> set[str]:
        return {self._file}


def create_backend(root: Path, dim: int, settings: IndexSettings, options: BackendOptions,
                   kind: str) -> CandidateBackend:
    """An empty backend for a new index folder."""
    if options.backend == "milvus":
        from index.milvus import MilvusCandidates  # pymilvus is imported only by indexes that use it

        return MilvusCandidates.create(root, dim, settings, options, kind)
    return FaissCandidates.create(dim, settings)


def open_backend(root: Path, dim: int, settings: IndexSettings, info: dict[str, Any],
                 options: BackendOptions | None) -> CandidateBackend:
    """The backend an index folder's committed `info` names (IndexLoadError when it cannot be opened,
    or when `options` ask for another backend than the index was built with)."""
    name = str(info.get("backend", "faiss"))
    if options is not None and options.backend != name:
        raise IndexLoadError(f"the index at {root} keeps its candidates in {name}, not {options.backend}: "
                             f"build it anew with --backend {options.backend}")
    if name == "milvus":
        from index.milvus import MilvusCandidates

        return MilvusCandidates.open(root, dim, settings, info, options)
    if name != "faiss":
        raise IndexLoadError(f"the index at {root} names an unknown candidate backend {name!r}")
    return FaissCandidates.open(root, dim, settings, info)


def entries_batches(items: np.ndarray, batch: int, entries: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The entries of `items` in batches of `batch` items."""
    for start in range(0, len(items), batch):
        yield entries(items[start : start + batch])
