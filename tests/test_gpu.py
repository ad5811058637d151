"""The device path end to end on a GPU: train, calibrate, load, embed, index and search on CUDA, and
the served path on CUDA and faiss-gpu against the CPU's answers.

Marked `gpu` and skipped where torch sees no GPU (the served test also where faiss has no GPU):
`./run test -m gpu tests/test_gpu.py` (README, "Tests"). The CPU side is tests/test_device.py, the
same paths on a second device without a GPU tests/test_device_mixing.py, and the served comparison
with a stand-in FAISS GPU tests/test_placement.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from index import ImageIndex, IndexSettings
from index.ann import gpu_available
from index.gpu import GpuCopy
from model.bundle import Bundle
from model.dataset import feature_cache, hold_out, load_split_data
from model.device import FAISS_GPU, MATRIX_CPU
from model.parsers import make_parser
from service.app import create_app, load_engine
from tests import served
from tests.conftest import ShapesModel
from training.train import make_run, train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_train_and_calibrate_on_cuda(shapes_model: ShapesModel, tmp_path: Path) -> None:
    run = make_run("paper", {"epochs": 3, "dense_epochs": 1, "anneal_epochs": 1, "batch_size": 20, "h": 32,
                             "eval_every": 3, "calibrate": 20, "device": "cuda"})
    parser = make_parser("spacy")
    tr = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, parser, device="cuda")
    rest, val = hold_out(tr, 10, seed=0)  # selection on held-out training images, as the trainer does
    summary = train(run, rest, val, tmp_path, shapes_model.cache)
    assert summary["config"]["train"]["device"].startswith("cuda")
    bundle = Bundle.load(tmp_path / "model.pt", device="cuda")
    assert bundle.device.type == "cuda" and bundle.calibration is not None
    assert bundle.calibration.ref_images.device.type == "cuda"


def test_cuda_and_cpu_bundles_agree(shapes_model: ShapesModel) -> None:
    gpu = Bundle.load(shapes_model.model_path, device="cuda")
    cpu = Bundle.load(shapes_model.model_path, device="cpu")
    enc = cpu.text.encode(["a red circle"])
    feats = shapes_model.dev.feats[:5]
    for b in (gpu, cpu):
        b.text.device = "cpu"  # the same word vectors for both
    s_gpu = gpu.scores(gpu.embed_images(feats), torch.ones(5, feats.shape[1]), *gpu.embed_sentences(enc))
    s_cpu = cpu.scores(cpu.embed_images(feats), torch.ones(5, feats.shape[1]), *cpu.embed_sentences(enc))
    assert s_gpu.device.type == "cpu"
    np.testing.assert_allclose(s_gpu.numpy(), s_cpu.numpy(), rtol=1e-4, atol=1e-5)


def test_index_search_on_cuda(shapes_model: ShapesModel, tmp_path: Path) -> None:
    """A search through FAISS (exact_below 0: 20 images are otherwise scanned whole), on its GPU copy
    where faiss has a GPU, ranks as the exact scan does."""
    bundle = Bundle.load(shapes_model.model_path, device="cuda")
    cache = feature_cache(shapes_model.cache, bundle.image_cfg, device="cuda")
    settings = IndexSettings.of(use_gpu=gpu_available(), exact_below=0, k_prime=4096)  # k' recalls every fragment
    index = ImageIndex.create(tmp_path / "images", bundle, settings, cache=cache, collection_root=shapes_model.data)
    index.photos.add(sorted((shapes_model.data / "images").glob("*.jpg"))[:20])
    hits = index.search("a red circle", 3).hits
    assert index.ranker.searches == {"scan": 0, "candidates": 1}, "FAISS's candidates answered"
    assert len(hits) == 3 and Path(hits[0].path).is_file()
    assert [h.image_id for h in hits] == [h.image_id for h in index.search("a red circle", 3, exhaustive=True).hits]
    if gpu_available():
        assert isinstance(index.candidates._gpu, GpuCopy)  # type: ignore[attr-defined]
    index.close()


@pytest.mark.skipif(not gpu_available(), reason="needs faiss-gpu and a GPU it sees")
def test_served_answers_on_cuda_and_faiss_gpu_are_the_cpus(shapes_model: ShapesModel, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection searched through FAISS (exact_below 0), loaded by the service's own loader on the
    CPU and on CUDA, served over HTTP: /search/images, /annotate (k' = 0: the range search FAISS's GPU
    indexes lack) and /search/fragments give the same ids in the same order, scores within a tolerance."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 on both sides: comparable scores
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    collection = served.prepare(shapes_model, tmp_path)
    answers = {}
    for device in ("cpu", "cuda"):
        settings = collection.settings(device=device)
        engine = load_engine(settings)
        with TestClient(create_app(settings, engine=engine)) as c:
            answers[device] = served.answers(c, collection)
        assert engine.sentences is not None
        if device == "cuda":
            assert engine.bundle.device.type == "cuda"
            assert engine.images.candidates.policy()["knn"] == FAISS_GPU
            assert engine.sentences.candidates.policy()["range"] == MATRIX_CPU
            assert isinstance(engine.images.candidates._gpu, GpuCopy)  # type: ignore[attr-defined]
        engine.images.close()
        engine.sentences.close()
    served.assert_same_answers(answers["cuda"], answers["cpu"])
