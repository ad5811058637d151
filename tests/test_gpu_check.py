"""What tools/gpu_check.py runs on the device it checks (GPU_CHECK_DEVICE: cuda by default, cpu for its dry
run): the service's ranked routes answered with the model on that device (its graphs on ONNX Runtime's
provider for it: the CUDA provider of onnxruntime-gpu on a GPU; FAISS's GPU copy where faiss has one) against
the CPU's answers, and one training epoch with the calibration on that device (torch). Marked `gpu`: skipped
where the device is cuda and torch sees no GPU.

    GPU_CHECK_DEVICE=cuda python -m pytest -m gpu tests/test_gpu_check.py
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import fragsearch.training.train
from fragsearch.model.backbone import backbone_graph
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import hold_out, load_split_data
from fragsearch.model.device import is_gpu
from fragsearch.model.encoders import ModelConfig
from fragsearch.model.onnx import session
from fragsearch.model.parsers import make_parser
from fragsearch.service.app import create_app, load_engine
from fragsearch.training.nets.encoders import build_model
from fragsearch.training.train import make_run, train
from tests import served
from tests.conftest import ShapesModel

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (GPU_CHECK_DEVICE=cpu: the dry run)")]


def graph_provider(device: str) -> str:
    """The execution provider ONNX Runtime runs the served backbone graph with on `device` (the first of the
    session's: what it fell back to, if the CUDA provider did not load)."""
    return str(session(backbone_graph("int8"), device).get_providers()[0])


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """Full fp32 matrix products on CUDA (no TF32) while a test runs: comparable scores on both sides.
    Set and restored by hand: torch 2.14's `fp32_precision` lives behind the cuBLAS module's
    __getattr__, which pytest's monkeypatch takes for an attribute it may delete."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    name = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"  # torch 2.14's name first
    before, cudnn_before = getattr(matmul, name), cudnn.allow_tf32
    setattr(matmul, name, "ieee" if name == "fp32_precision" else False)
    cudnn.allow_tf32 = False
    try:
        yield
    finally:
        setattr(matmul, name, before)
        cudnn.allow_tf32 = cudnn_before


@pytest.mark.usefixtures("no_tf32")
def test_ranked_routes_answer_on_the_device_as_on_the_cpu(shapes_model: ShapesModel, tmp_path: Path) -> None:
    """/search/images, /annotate (k' = 0) and /search/fragments through FAISS (exact_below 0), loaded by the
    service's own loader on the CPU and on the device, answered over HTTP: the same ids in the same order,
    scores within tests/served.py's tolerance; the model is where it was asked to be, and its graphs run on
    that device's provider (CUDA's on a GPU, not a silent fall-back to the CPU's)."""
    collection = served.prepare(shapes_model, tmp_path)
    answers = {}
    for device in ("cpu", DEVICE):
        settings = collection.settings(device=device)
        engine = load_engine(settings)
        with TestClient(create_app(settings, engine=engine)) as c:
            answers[device] = served.answers(c, collection)
        assert engine.bundle.device == device
        engine.images.close()
        if engine.sentences is not None:
            engine.sentences.close()
    served.assert_same_answers(answers[DEVICE], answers["cpu"])
    assert graph_provider(DEVICE) == ("CUDAExecutionProvider" if is_gpu(DEVICE) else "CPUExecutionProvider")


def test_one_epoch_and_the_calibration_on_the_device(shapes_model: ShapesModel, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's torch modules are built and trained on the device; the model it keeps loads there with its
    calibration."""
    built: list[torch.nn.Module] = []

    def build_and_keep(cfg: ModelConfig) -> torch.nn.Module:
        built.append(build_model(cfg))
        return built[-1]

    monkeypatch.setattr(fragsearch.training.train, "build_model", build_and_keep)
    run = make_run("paper", {"epochs": 1, "dense_epochs": 1, "anneal_epochs": 1, "batch_size": 20, "h": 32,
                             "eval_every": 1, "calibrate": 20, "device": DEVICE})
    parser = make_parser("spacy")
    tr = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, parser, device=DEVICE)
    rest, val = hold_out(tr, 10, seed=0)
    t0 = time.perf_counter()
    summary = train(run, rest, val, tmp_path, shapes_model.cache)
    assert time.perf_counter() - t0 < 300
    assert len(summary["history"]) == 1 and summary["config"]["train"]["device"].startswith(DEVICE)
    assert [{p.device.type for p in m.parameters()} for m in built] == [{torch.device(DEVICE).type}]
    bundle = Bundle.load(tmp_path / "model.pt", device=DEVICE)  # the runtime's view of it, served on the device
    assert bundle.device == DEVICE and bundle.calibration is not None
