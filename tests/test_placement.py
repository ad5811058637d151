"""The device policy (model.device.placement) and the FAISS index following it (index.ann, index.gpu).

The GPU side runs on a stand-in FAISS GPU here (tests.gpu_stand_in: CPU clones that, like FAISS's
GPU indexes, have no range search and notice concurrent calls); tests/test_gpu.py runs the same
on faiss-gpu.
"""

from __future__ import annotations

import itertools
import logging
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fragsearch.index import ImageIndex, SentenceIndex
from fragsearch.index import ids as fid
from fragsearch.index.ann import FaissCandidates
from fragsearch.index.types import IndexSettings
from fragsearch.model.device import (
    CALLS,
    CODES_CPU,
    EXACT_CPU,
    FAISS_CPU,
    FAISS_GPU,
    FAISS_GPU_MAX_K,
    GPU_KNN_CPU_RANGE,
    MATRIX_CPU,
    placement,
)
from fragsearch.service.app import create_app, load_engine
from fragsearch.service.engine import Engine
from tests import gpu_stand_in, served
from tests.conftest import ShapesModel

# call, kind, ivfpq code bits, gpu (model on a GPU and faiss-gpu), k -> where it runs
POLICY = [
    ("knn", "flat", 8, True, 128, FAISS_GPU),
    ("knn", "flat", 8, True, FAISS_GPU_MAX_K + 1, FAISS_CPU),  # past FAISS's GPU k-selection limit
    ("knn", "ivf", 8, True, 128, FAISS_GPU),
    ("knn", "ivfpq", 8, True, 128, FAISS_GPU),
    ("knn", "ivfpq", 4, True, 128, FAISS_CPU),  # 4-bit fast-scan codes have no GPU version
    ("knn", "hnsw", 8, True, 128, FAISS_CPU),  # nor has hnsw
    ("range", "flat", 8, True, 1, MATRIX_CPU),  # FAISS's GPU indexes have no range search
    ("range", "ivf", 8, True, 1, GPU_KNN_CPU_RANGE),
    ("range", "ivfpq", 8, True, 1, GPU_KNN_CPU_RANGE),
    ("range", "ivfpq", 4, True, 1, FAISS_CPU),
    ("range", "hnsw", 8, True, 1, FAISS_CPU),
    ("exact", "flat", 8, True, 1, EXACT_CPU),
    ("exact", "ivfpq", 8, True, 1, EXACT_CPU),
    ("prescore", "ivfpq", 8, True, 1, CODES_CPU),  # beside the codes, in host memory
    ("write", "flat", 8, True, 1, FAISS_CPU),
    ("write", "ivf", 8, True, 1, FAISS_CPU),
    ("knn", "flat", 8, False, 128, FAISS_CPU),
    ("knn", "ivf", 8, False, 128, FAISS_CPU),
    ("knn", "ivfpq", 8, False, 128, FAISS_CPU),
    ("knn", "hnsw", 8, False, 128, FAISS_CPU),
    ("range", "flat", 8, False, 1, MATRIX_CPU),
    ("range", "ivf", 8, False, 1, FAISS_CPU),
    ("range", "ivfpq", 8, False, 1, FAISS_CPU),
    ("range", "hnsw", 8, False, 1, FAISS_CPU),
    ("exact", "flat", 8, False, 1, EXACT_CPU),
    ("prescore", "ivfpq", 4, False, 1, CODES_CPU),
    ("write", "flat", 8, False, 1, FAISS_CPU),
]


@pytest.mark.parametrize(("call", "kind", "nbits", "gpu", "k", "where"), POLICY)
def test_the_policy_table(call: str, kind: str, nbits: int, gpu: bool, k: int, where: str) -> None:
    assert placement(call, kind, gpu, nbits, k) == where


def test_range_searches_and_exact_scores_never_run_on_a_faiss_gpu_copy() -> None:
    for kind, nbits, gpu, k in itertools.product(("flat", "ivf", "ivfpq", "hnsw"), (4, 8), (True, False), (1, 4096)):
        assert placement("range", kind, gpu, nbits, k) != FAISS_GPU
        assert placement("exact", kind, gpu, nbits, k) == EXACT_CPU
        assert placement("write", kind, gpu, nbits, k) == FAISS_CPU
    with pytest.raises(ValueError, match="call must be one of"):
        placement("scan", "flat", True)
    assert set(CALLS) == {row[0] for row in POLICY}


# -- the FAISS index follows it -----------------------------------------------------------------------
DIM = 8


def _ann(settings: IndexSettings, n: int = 400, seed: int = 0) -> tuple[FaissCandidates, np.ndarray]:
    """An index of n random vectors (items of 4 fragments), built as its kind needs."""
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    ids = np.concatenate([fid.item_fragments(i, 4) for i in range(n // 4)])
    if settings.shape.trainable:
        ann = FaissCandidates.build(DIM, settings, vecs, [(ids, vecs)])
    else:
        ann = FaissCandidates(DIM, settings)
        ann.add(ids, vecs)
    return ann, vecs


def _pairs(scores: np.ndarray, ids: np.ndarray) -> list[tuple[int, float]]:
    return sorted((int(i), round(float(s), 4)) for s, i in zip(scores, ids, strict=True))


def _summed(scores: np.ndarray, ids: np.ndarray) -> dict[int, float]:
    out: dict[int, float] = {}
    for s, i in zip(scores, ids, strict=True):
        out[int(i)] = out.get(int(i), 0.0) + float(s)
    return {i: round(s, 4) for i, s in out.items()}


def test_a_flat_index_on_the_gpu_searches_its_copy_and_range_searches_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The served default (flat; the sentence index with k' = 0): k-NN on the GPU copy, every positive
    fragment by matrix products on the CPU, never a range search on the copy (FAISS's GPU indexes
    have none: that is what kept /annotate, and so /readyz, failing on a GPU)."""
    n = FAISS_GPU_MAX_K + 400
    cpu, vecs = _ann(IndexSettings(), n)
    queries = np.random.default_rng(1).standard_normal((3, DIM)).astype(np.float32)
    stand_in = gpu_stand_in.install(monkeypatch)
    gpu, _ = _ann(IndexSettings.of(use_gpu=True), n)
    assert gpu.policy() == {"knn": FAISS_GPU, "range": MATRIX_CPU, "exact": EXACT_CPU, "prescore": CODES_CPU,
                            "write": FAISS_CPU}
    for a, b in zip(gpu.search(queries, 10), cpu.search(queries, 10), strict=True):
        np.testing.assert_array_equal(a, b)
    assert stand_in.calls == 1
    assert _summed(*gpu.search_positive(queries)) == _summed(*cpu.search_positive(queries))
    assert stand_in.calls == 1  # the range search did not touch the copy
    gpu.search(queries, FAISS_GPU_MAX_K + 1)  # more neighbours than a GPU selects: the CPU index
    assert stand_in.calls == 1


def test_an_ivf_index_on_the_gpu_range_searches_by_gpu_knn_and_cpu_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """ivf with k' = 0: k-NN on the GPU copy, and the CPU index for the queries whose k-NN are all
    positive (more may be): the same fragments and scores as the CPU's range search."""
    settings = IndexSettings.of(kind="ivf", nlist=4, nprobe=4, train_size=100)
    cpu, vecs = _ann(settings)
    queries = np.random.default_rng(2).standard_normal((3, DIM)).astype(np.float32)
    stand_in = gpu_stand_in.install(monkeypatch)
    gpu, _ = _ann(settings.with_search(use_gpu=True))
    assert gpu.placement("range") == GPU_KNN_CPU_RANGE
    cpu_few = cpu.index.range_search(queries, 0.0)
    assert _pairs(*gpu.search_positive(queries)) == _pairs(cpu_few[1], cpu_few[2])
    assert stand_in.calls == 1
    # a query whose every k-NN is positive (k = all 400 here, under the GPU's limit only because the
    # index is small): the overflow goes to the CPU index, and nothing is lost
    positive = np.abs(vecs).astype(np.float32)
    gpu.remove_ids(np.concatenate([fid.item_fragments(i, 4) for i in range(100)]))
    cpu.remove_ids(np.concatenate([fid.item_fragments(i, 4) for i in range(100)]))
    ids = np.concatenate([fid.item_fragments(i, 4) for i in range(100)])
    gpu.add(ids, positive)
    cpu.add(ids, positive)
    both = np.concatenate([positive.mean(0, keepdims=True), queries])
    cpu_all = cpu.index.range_search(both, 0.0)
    assert (cpu_all[0][1] - cpu_all[0][0]) == len(vecs)  # the first query: every fragment positive
    assert _pairs(*gpu.search_positive(both)) == _pairs(cpu_all[1], cpu_all[2])
    assert stand_in.calls == 2


def test_kinds_without_a_gpu_version_stay_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = gpu_stand_in.install(monkeypatch)
    for settings in (IndexSettings.of(kind="hnsw", use_gpu=True),
                     IndexSettings.of(kind="ivfpq", nlist=4, m=4, nbits=4, train_size=100, use_gpu=True)):
        ann, vecs = _ann(settings)
        assert ann.active_kind == settings.shape.kind
        assert ann.policy()["knn"] == FAISS_CPU
        ann.search(vecs[:2], 5)
        ann.search_positive(vecs[:2])
    assert stand_in.copies == []


def test_without_use_gpu_nothing_goes_to_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = gpu_stand_in.install(monkeypatch)
    ann, vecs = _ann(IndexSettings.of(kind="ivf", nlist=4, train_size=100))
    ann.search(vecs[:2], 5)
    ann.search_positive(vecs[:2])
    assert stand_in.copies == [] and set(ann.policy().values()) == {FAISS_CPU, EXACT_CPU, CODES_CPU}


def test_calls_on_the_gpu_copy_are_serialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four threads search at once (as the service does): the GPU copy sees one call at a time.
    Each call lingers for a second caller, so calls that were not serialised would overlap."""
    stand_in = gpu_stand_in.install(monkeypatch, linger=0.5)
    ann, vecs = _ann(IndexSettings.of(use_gpu=True))
    ann.search(vecs[:1], 3)  # the copy exists before the threads start
    start = threading.Barrier(4)

    def search() -> None:
        start.wait()
        ann.search(vecs[:2], 5)

    threads = [threading.Thread(target=search) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stand_in.calls == 5
    assert not stand_in.overlapped


# -- the served path ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def collection(shapes_model: ShapesModel, tmp_path_factory: pytest.TempPathFactory) -> served.Collection:
    return served.prepare(shapes_model, tmp_path_factory.mktemp("served"))


def test_served_answers_with_the_gpu_placements_match_the_cpus(collection: served.Collection,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """tests/test_gpu.py's served comparison with the model on the CPU and FAISS's GPU a stand-in: the
    indexes loaded as on a GPU (use_gpu) and served over HTTP give every answer the CPU's, /annotate
    (the sentence index's range search, what the warm-up does) included."""
    settings = collection.settings(device="cpu")
    with TestClient(create_app(settings, engine=load_engine(settings))) as c:
        want = served.answers(c, collection)
    stand_in = gpu_stand_in.install(monkeypatch)
    bundle = collection.shapes.bundle
    engine = Engine(settings, bundle,
                    ImageIndex.load(settings.image_index, bundle, collection_root=settings.collection_root,
                                    use_gpu=True),
                    SentenceIndex.load(settings.sentence_index, bundle, use_gpu=True))
    with caplog.at_level(logging.INFO, logger="fragsearch.service.engine"):
        engine.log_device_policy()
    assert ("image index (faiss flat): knn faiss-gpu, range matrix-cpu, exact numpy-cpu, prescore codes-cpu, "
            "write faiss-cpu"
            in caplog.text)
    assert "sentence index (faiss flat): knn faiss-gpu, range matrix-cpu" in caplog.text
    with TestClient(create_app(settings, engine=engine)) as c:
        got = served.answers(c, collection)
    served.assert_same_answers(got, want)
    assert stand_in.calls >= len(collection.sentences) + len(collection.phrases)  # image searches on the "GPU"
    assert not stand_in.overlapped
