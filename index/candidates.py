"""The candidate backend interface: where the fragment vectors are searched for candidates (the
exact S_kl re-rank then reads the re-rank store, index.store, and calls model.score on every backend).

`CandidateBackend` is the interface the index's parts use (index.base writes, index.ranker recalls,
index.saving persists); its implementations are `fragsearch.index.ann.FaissCandidates`, the
in-process FAISS index saved as a `faiss-*.index` file beside the catalogue (the embedded default),
and `fragsearch.index.milvus.MilvusCandidates`, a Milvus collection (milvus-lite in a local folder, or a Milvus
server or cluster by URI); `fragsearch.index.backends` opens the one an index names. Ids are `fragsearch.index.ids`
fragment ids (item · 2^10 + row).

Persistence follows the index's commit protocol (index.saving): `persist` prepares what the next
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

from fragsearch.index.types import IndexSettings
from fragsearch.model.device import CODES_CPU, EXACT_CPU

logger = logging.getLogger(__name__)


Batches = Iterable[tuple[np.ndarray, np.ndarray]]  # (fragment ids (N,), vectors (N, dim) float32)


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
        return {"knn": self.NAME, "range": self.NAME, "exact": EXACT_CPU, "prescore": CODES_CPU, "write": self.NAME}

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


def entries_batches(items: np.ndarray, batch: int, entries: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The entries of `items` in batches of `batch` items."""
    for start in range(0, len(items), batch):
        yield entries(items[start : start + batch])
