"""A FAISS index opened mapped (index/ann.py, the service's `candidates_mapped`): its stored vectors stay in its
file, a recall's scan lets their pages go, the same answers as in memory, and a write reads them in first."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from fragsearch.index.ann import POSITIVE_CHUNK, FaissCandidates
from fragsearch.index.backends import open_backend
from fragsearch.index.store import mapping_of, release_mapped
from fragsearch.index.types import BackendOptions, IndexSettings
from fragsearch.settings import Settings

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the mapping is found in Linux's table of them")
DIM = 64
ROWS = 3 * POSITIVE_CHUNK // 2  # a scan of two chunks


def _committed(root: Path) -> tuple[dict[str, object], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    ids = np.arange(ROWS, dtype=np.int64) * 7
    ann = FaissCandidates(DIM, IndexSettings())
    ann.add(ids, vecs)
    info = ann.persist(root, 1, [])
    ann.committed(info)
    return info, ids, vecs


def _resident(path: Path) -> int:
    """Resident bytes of this process's mappings of `path`."""
    return sum(int(m.rss) for m in psutil.Process().memory_maps(grouped=True)
               if Path(m.path) == path.resolve())


def test_a_mapped_index_answers_as_in_memory_and_holds_no_pages_after_a_scan(tmp_path: Path) -> None:
    info, ids, vecs = _committed(tmp_path)
    file = tmp_path / str(info["ann_file"])
    held = FaissCandidates.open(tmp_path, DIM, IndexSettings(), info)
    mapped = FaissCandidates.open(tmp_path, DIM, IndexSettings(), info, mapped=True)
    stored = mapped._flat_vectors()
    assert stored is not None
    assert mapping_of(file, stored[0].ctypes.data) is not None  # the vectors are the file's bytes
    in_memory = held._flat_vectors()
    assert in_memory is not None and mapping_of(file, in_memory[0].ctypes.data) is None
    queries = vecs[:3] + 0.5
    for a, b in zip(held.search_positive(queries), mapped.search_positive(queries), strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(mapped.search(queries, 5)[1], held.search(queries, 5)[1])
    np.asarray(stored[0]).sum()  # every page read: resident
    assert _resident(file) > ROWS * DIM * 4 // 2
    mapped.search_positive(queries)
    assert _resident(file) < ROWS * DIM * 4 // 10  # let go chunk by chunk


def test_a_write_reads_the_vectors_in_and_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    info, ids, vecs = _committed(tmp_path)
    file = tmp_path / str(info["ann_file"])
    before = file.read_bytes()
    mapped = FaissCandidates.open(tmp_path, DIM, IndexSettings(), info, mapped=True)
    assert mapped.remove_ids(ids[:10]) == 10
    mapped.add(np.asarray([1], np.int64), np.ones((1, DIM), np.float32))
    assert mapped.ntotal == ROWS - 9
    stored = mapped._flat_vectors()
    assert stored is not None and mapping_of(file, stored[0].ctypes.data) is None
    assert file.read_bytes() == before
    assert mapped.search(np.ones((1, DIM), np.float32), 1)[1][0, 0] == 1


def test_release_never_reaches_past_the_mapping(tmp_path: Path) -> None:
    info, _, _ = _committed(tmp_path)
    file = tmp_path / str(info["ann_file"])
    mapped = FaissCandidates.open(tmp_path, DIM, IndexSettings(), info, mapped=True)
    stored = mapped._flat_vectors()
    assert stored is not None
    start, end = mapping = mapping_of(file, stored[0].ctypes.data) or (0, 0)
    assert end > start
    owned = np.arange(1 << 20, dtype=np.float32)  # this process's own memory, around the call
    release_mapped(mapping, start - (1 << 30), end + (1 << 30))  # clamped to the mapping: nothing else let go
    assert float(owned[-1]) == float((1 << 20) - 1) and float(owned.sum()) > 0
    assert mapped.search_positive(stored[0][:1])[0].size > 0  # the mapping reads back from the file


def test_the_service_setting_reaches_the_backend(tmp_path: Path) -> None:
    info, _, _ = _committed(tmp_path)
    assert Settings().backend.mapped is True
    assert Settings(candidates_mapped=False).backend.mapped is False
    opened = open_backend(tmp_path, DIM, IndexSettings(), info, BackendOptions(mapped=True))
    assert isinstance(opened, FaissCandidates) and opened._mapped == tmp_path / str(info["ann_file"])
    assert isinstance(held := open_backend(tmp_path, DIM, IndexSettings(), info, None), FaissCandidates)
    assert held._mapped is None
