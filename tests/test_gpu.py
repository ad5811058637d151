"""The device path end to end on a GPU: train and calibrate on CUDA (torch, the trainer), the runtime's graphs
on ONNX Runtime's CUDA provider, an index searched on CUDA, and the served path on CUDA and faiss-gpu against the
CPU's answers.

Marked `gpu`; the trainer's test is skipped where torch sees no GPU, the runtime's where ONNX Runtime has no CUDA
provider or no GPU is visible (the served test also where faiss has no GPU): `./run test -m gpu tests/test_gpu.py`
(README, "Tests"). The CPU side is tests/test_device.py, the same paths on a second device without a GPU
tests/test_device_mixing.py, and the served comparison with a stand-in FAISS GPU tests/test_placement.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.ann import gpu_available
from fragsearch.index.gpu import GpuCopy
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import feature_cache, hold_out, load_split_data
from fragsearch.model.device import FAISS_GPU, MATRIX_CPU, gpu_count
from fragsearch.model.onnx import providers
from fragsearch.model.parsers import make_parser
from fragsearch.service.app import create_app, load_engine
from tests import served
from tests.conftest import ShapesModel

pytestmark = pytest.mark.gpu

runtime_gpu = pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers() or not gpu_count()[0],
    reason="needs onnxruntime-gpu and a GPU it sees")


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


trainer_gpu = pytest.mark.skipif(not _torch_cuda(), reason="needs torch with a CUDA GPU (the train extra)")


@trainer_gpu
def test_train_and_calibrate_on_cuda(shapes_model: ShapesModel, tmp_path: Path) -> None:
    from fragsearch.training.nets.checkpoint import Checkpoint
    from fragsearch.training.train import make_run, train

    run = make_run("paper", {"epochs": 3, "dense_epochs": 1, "anneal_epochs": 1, "batch_size": 20, "h": 32,
                             "eval_every": 3, "calibrate": 20, "device": "cuda"})
    parser = make_parser("spacy")
    tr = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, parser, device="cuda")
    rest, val = hold_out(tr, 10, seed=0)  # selection on held-out training images, as the trainer does
    summary = train(run, rest, val, tmp_path, shapes_model.cache)
    assert summary["config"]["train"]["device"].startswith("cuda")
    ckpt = Checkpoint.load(tmp_path / "model.pt", device="cuda")
    assert ckpt.device.type == "cuda" and ckpt.calibration is not None
    assert ckpt.bundle().device == "cuda"
    # the modules trained on CUDA score as the runtime's NumPy form of them does on the CPU
    cpu = Bundle.load(tmp_path / "model.pt", device="cpu")
    enc = cpu.text.encode(["a red circle"])
    feats = tr.feats[:5]
    mask = np.ones((5, feats.shape[1]), dtype=np.float32)
    s_gpu = ckpt.scores(ckpt.embed_images(feats), mask, *ckpt.embed_sentences(enc))
    s_cpu = cpu.scores(cpu.embed_images(feats), mask, *cpu.embed_sentences(enc))
    np.testing.assert_allclose(np.asarray(s_gpu), s_cpu, rtol=1e-4, atol=1e-5)


@runtime_gpu
def test_runtime_graphs_on_cuda_embed_as_on_the_cpu(shapes_model: ShapesModel) -> None:
    """MiniLM and the image backbone on ONNX Runtime's CUDA provider give the CPU's vectors."""
    assert providers("cuda")[0] == "CUDAExecutionProvider"
    gpu = Bundle.load(shapes_model.model_path, device="cuda")
    cpu = Bundle.load(shapes_model.model_path, device="cpu")
    texts = ["a red circle", "two blue squares beside a green triangle"]
    s_gpu, m_gpu = gpu.embed_sentences(gpu.text.encode(texts))
    s_cpu, m_cpu = cpu.embed_sentences(cpu.text.encode(texts))
    np.testing.assert_array_equal(m_gpu, m_cpu)
    np.testing.assert_allclose(s_gpu, s_cpu, rtol=1e-3, atol=1e-4)
    with Image.open(sorted((shapes_model.data / "images").glob("*.jpg"))[0]) as image:
        f_gpu = gpu.extractor.extract(image)
        f_cpu = cpu.extractor.extract(image)
    # the whole frame's features (row 0): the int8 graph's kernels differ between providers by rounding
    np.testing.assert_allclose(f_gpu.features[0], f_cpu.features[0], rtol=5e-2, atol=5e-2)


@runtime_gpu
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


@runtime_gpu
@pytest.mark.skipif(not gpu_available(), reason="needs faiss-gpu and a GPU it sees")
def test_served_answers_on_cuda_and_faiss_gpu_are_the_cpus(shapes_model: ShapesModel, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection searched through FAISS (exact_below 0), loaded by the service's own loader on the
    CPU and on CUDA, served over HTTP: /search/images, /annotate (k' = 0: the range search FAISS's GPU
    indexes lack) and /search/fragments give the same ids in the same order, scores within a tolerance."""
    collection = served.prepare(shapes_model, tmp_path)
    answers = {}
    for device in ("cpu", "cuda"):
        settings = collection.settings(device=device)
        engine = load_engine(settings)
        with TestClient(create_app(settings, engine=engine)) as c:
            answers[device] = served.answers(c, collection)
        assert engine.sentences is not None
        if device == "cuda":
            assert engine.bundle.device == "cuda"
            assert engine.images.candidates.policy()["knn"] == FAISS_GPU
            assert engine.sentences.candidates.policy()["range"] == MATRIX_CPU
            assert isinstance(engine.images.candidates._gpu, GpuCopy)  # type: ignore[attr-defined]
        engine.images.close()
        engine.sentences.close()
    served.assert_same_answers(answers["cuda"], answers["cpu"])
