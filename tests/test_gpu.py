"""The device path end to end on a GPU: train, calibrate, load, embed, index and search on CUDA.

Marked `gpu` and skipped where torch sees no GPU (the CPU side is tests/test_device.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from index import ImageIndex, IndexSettings
from index.ann import gpu_available
from model.bundle import Bundle
from model.dataset import feature_cache, hold_out, load_split_data
from model.text import make_parser
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
    bundle = Bundle.load(shapes_model.model_path, device="cuda")
    cache = feature_cache(shapes_model.cache, bundle.image_cfg, device="cuda")
    index = ImageIndex.create(tmp_path / "images", bundle, IndexSettings(use_gpu=gpu_available()), cache=cache,
                              collection_root=shapes_model.data)
    index.add_paths(sorted((shapes_model.data / "images").glob("*.jpg"))[:20])
    hits = index.search("a red circle", 3)
    assert len(hits) == 3 and Path(hits[0].path).is_file()
