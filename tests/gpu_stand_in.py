"""A FAISS GPU for machines without one: GPU copies that are CPU clones, behaving as FAISS's GPU
indexes do where the service depends on it.

`install(monkeypatch)` makes `fragsearch.index.gpu.faiss_gpu()` hand out copies made by a `StandIn` (the real
one has faiss-gpu make them with `index_cpu_to_gpu`): every search still goes through
`fragsearch.index.gpu.GpuCopy` and its lock, so the placement policy's GPU decisions run as on a GPU. A copy
offers `search` only (FAISS's GPU indexes have no range search: calling one fails), counts its calls,
and notices two calls at once (FAISS's GPU indexes are not safe for concurrent use); with `linger`
each call waits that long for a second caller to show up, so that unserialised calls overlap.
"""

from __future__ import annotations

import threading
from typing import Any

import faiss
import numpy as np
import pytest

import fragsearch.index.gpu
from fragsearch.index.gpu import FaissGpu


class StandInCopy:
    """A CPU clone of an index in place of its GPU copy."""

    def __init__(self, source: faiss.Index, linger: float) -> None:
        self._index = faiss.clone_index(source)
        self.ntotal = source.ntotal
        self.metric_type = source.metric_type
        self.d = source.d
        self.calls = 0
        self.overlapped = threading.Event()
        self._linger = linger
        self._active = 0
        self._count = threading.Lock()

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        with self._count:
            self._active += 1
            self.calls += 1
            if self._active > 1:
                self.overlapped.set()
        try:
            if self._linger:
                self.overlapped.wait(self._linger)
            return self._index.search(queries, k)
        finally:
            with self._count:
                self._active -= 1


class StandIn:
    """The copies made so far (`copies`) and the `FaissGpu` that makes them."""

    def __init__(self, linger: float = 0.0) -> None:
        self.copies: list[StandInCopy] = []
        self.linger = linger
        self.gpu = FaissGpu(self._copy, "stand-in")

    def _copy(self, source: faiss.Index) -> Any:  # what faiss-gpu's index_cpu_to_gpu would give
        copy = StandInCopy(source, self.linger)
        self.copies.append(copy)
        return copy

    @property
    def calls(self) -> int:
        return sum(c.calls for c in self.copies)

    @property
    def overlapped(self) -> bool:
        return any(c.overlapped.is_set() for c in self.copies)


def install(monkeypatch: pytest.MonkeyPatch, linger: float = 0.0) -> StandIn:
    """The process's FAISS GPU is a `StandIn` until the test ends."""
    stand_in = StandIn(linger)
    monkeypatch.setattr(fragsearch.index.gpu, "_shared", stand_in.gpu)
    monkeypatch.setattr(fragsearch.index.gpu, "_checked", True)
    return stand_in
