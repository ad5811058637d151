"""The process's FAISS GPU: one resource, and one call at a time on it.

FAISS's GPU indexes are not safe for concurrent use, not even for searches: their
`StandardGpuResources` keeps one scratch area for one caller at a time (FAISS wiki, "Threads and
asynchronous calls"). The service searches from several threads, so every GPU copy of the process
shares one resource and every call on a copy (making it, searching it) holds one lock. A copy is a
`GpuCopy`, which offers k-NN search only: FAISS's GPU indexes have no range search
(model.device.placement sends range searches elsewhere).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import faiss
import numpy as np

logger = logging.getLogger(__name__)

Copier = Callable[[faiss.Index], faiss.Index]


class GpuCopy:
    """An index's copy on the GPU; `search` holds the process's GPU lock (FAISS contrib's
    `range_search_gpu` takes it in place of a GPU index: it reads `ntotal`, `metric_type` and
    calls `search`)."""

    def __init__(self, index: faiss.Index, lock: threading.Lock) -> None:
        self._index = index
        self._lock = lock
        self.ntotal = int(index.ntotal)
        self.metric_type = index.metric_type
        self.d = int(index.d)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            scores, ids = self._index.search(queries, k)
        return scores, ids


class FaissGpu:
    """Makes GPU copies of FAISS indexes with one resource; every call on them is serialised."""

    def __init__(self, copier: Copier, name: str) -> None:
        self._copier = copier
        self.name = name
        self.lock = threading.Lock()

    def copy(self, index: faiss.Index) -> GpuCopy:
        """A GPU copy of `index` (RuntimeError when FAISS has no GPU version of its kind)."""
        with self.lock:
            return GpuCopy(self._copier(index), self.lock)


_shared: FaissGpu | None = None
_checked = False
_guard = threading.Lock()


def faiss_gpu() -> FaissGpu | None:
    """The process's FAISS GPU, GPU 0 (made on first use), or None without faiss-gpu or a GPU it sees."""
    global _shared, _checked
    with _guard:
        if not _checked:
            _checked = True
            if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
                res = faiss.StandardGpuResources()
                _shared = FaissGpu(lambda index: faiss.index_cpu_to_gpu(res, 0, index), "faiss-gpu:0")
                logger.info("FAISS searches on GPU 0 (one resource, one call at a time)")
        return _shared
