"""The served default's own paths on a device other than the CPU, without a GPU.

The released model is the `full-2x256` variant (model/released/manifest.json): two members merged into one
model whose S_kl thresholds each member's block apart, trained with input dropout, its sentences'
word vectors computed by MiniLM (contextual, with the whole-sentence fragment) and its images'
regions by the int8 backbone. Here the recipe, at a small h on four images of random features, is
trained on `tests.other_device`'s `cuda` (CPU data checked as CUDA checks it: a CPU tensor mixed with a
device tensor, or a `.numpy()` of a device tensor, fails): training both members and the merge with dropout
drawn on the device. Then a checkpoint trained on the CPU is served with the device set to `cuda`: MiniLM's
contextual vectors of unseen sentences, the int8 extraction of a picture (their graphs on ONNX Runtime's
providers for the device: its CUDA provider where onnxruntime-gpu has it, else the CPU's), the embedding and
S_kl (NumPy on the CPU, model/device.py), with the CPU's answers. (tests/test_device_mixing.py covers every
encoder, objective and scoring path one by one; tests/test_gpu.py the same on a real GPU.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import fragsearch.model.backbone
import fragsearch.model.bundle
import fragsearch.model.device
import fragsearch.training.train
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel, InputDropout
from fragsearch.training.train import make_run, train_members
from tests.other_device import on_device, other_device
from tests.test_device_mixing import CAPTIONS, tiny_split  # noqa: F401  (the module's fixture, shared)

VARIANT = "full-2x256"
H = 16  # each member's h (the variant's 256, made small): the merged model is 2 x 16 wide
UNSEEN = ["a blue circle beside a green square", "the yellow triangle"]  # encoded at serving time


def run_on(device: str) -> fragsearch.training.train.Run:
    return make_run(VARIANT, {"epochs": 2, "dense_epochs": 1, "anneal_epochs": 1, "batch_size": 4, "h": H,
                              "device": device, "calibrate": 4, "selection": "last"})


@pytest.fixture(scope="module")
def served_default(tiny_split: SplitData, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The variant's merged checkpoint, trained on the CPU."""
    out = tmp_path_factory.mktemp("default")
    train_members(run_on("cpu"), tiny_split, None, out, out / "cache")
    return out / "model.pt"


@pytest.fixture
def device_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device checks (no GPU is visible here) are told that the other device is there."""
    for module in (fragsearch.model.device, fragsearch.model.bundle, fragsearch.model.backbone):
        monkeypatch.setattr(module, "resolve_device", lambda name="auto": str(name))
    monkeypatch.setattr(fragsearch.training.train, "device_name", str)


def test_the_recipe_is_the_released_models(served_default: Path) -> None:
    bundle = Bundle.load(served_default)
    assert isinstance(Checkpoint.load(served_default).model, FragmentModel) and bundle.meta["variant"] == VARIANT
    assert (bundle.blocks, bundle.dim) == (2, 2 * H), "two members side by side"
    assert bundle.cfg.input_dropout > 0, "trained with input dropout"
    assert bundle.text.cfg.word_vectors == "contextual" and bundle.text.cfg.sentence_fragment
    assert (bundle.image_cfg.backbone_precision, bundle.image_cfg.region_features) == ("int8", "crop")
    assert bundle.calibration is not None


def test_input_dropout_draws_its_masks_on_the_device() -> None:
    drop = InputDropout(0.5).train()
    with other_device() as dev:
        x = torch.ones(64, 32, device=dev, requires_grad=True)
        y = drop(x)
        assert on_device(y)
        kept = y.detach().cpu() != 0
        assert 0.3 < float(kept.float().mean()) < 0.7, "about half the elements dropped"
        assert torch.all(y.detach().cpu()[kept] == 2.0), "the kept ones scaled by 1 / (1 - p)"
        y.sum().backward()
        assert x.grad is not None and on_device(x.grad)
        assert torch.equal(drop.eval()(x), x), "nothing dropped at evaluation"


def test_the_recipe_trains_and_merges_on_the_device(tiny_split: SplitData, served_default: Path,  # noqa: F811
                                                    tmp_path: Path, device_accepted: None) -> None:
    """Both members (input dropout drawn on the device) and their merge, calibrated anew, on the device:
    the merged checkpoint has the CPU's shape and loads on either side. (The dropout masks are drawn by
    torch on the device and by NumPy on the CPU, so the weights are not the CPU run's; the training
    captions' word vectors come from the CPU run's cache, as a second run's do.)"""
    with other_device():
        summary = train_members(run_on("cuda"), tiny_split, None, tmp_path, served_default.parent / "cache")
    assert len(summary["member_epochs"]) == 2
    for member in ("member-1", "member-2"):
        history = json.loads((tmp_path / member / "history.json").read_text())
        assert history["config"]["train"]["device"] == "cuda", "the member trained on the device"
    merged = Checkpoint.load(tmp_path / "model.pt")
    assert (merged.blocks, merged.dim) == (2, 2 * H) and merged.calibration is not None
    state = merged.model.state_dict()
    assert all(torch.isfinite(t).all() for t in state.values())


def picture() -> Image.Image:
    image = Image.new("RGB", (160, 120), (240, 240, 240))
    draw = ImageDraw.Draw(image)
    draw.ellipse((20, 20, 80, 80), fill=(200, 30, 30))
    draw.rectangle((95, 40, 150, 100), fill=(30, 30, 200))
    return image


def served_answers(bundle: Bundle) -> tuple[np.ndarray, ...]:
    """What serving computes for a picture and unseen sentences: the picture's int8 regions and their
    embedded fragments, the sentences' fragments (MiniLM's contextual word vectors and the whole-sentence
    fragment), S_kl of each pair."""
    frags = bundle.extractor.extract(picture())
    enc = bundle.text.encode(UNSEEN)
    img = bundle.embed_images(frags.features[None])
    sent, mask = bundle.embed_sentences(enc)
    scores = bundle.scores(img, np.ones(img.shape[:2], np.float32), sent, mask)
    return frags.boxes, frags.features, img, sent, mask, scores


def test_the_served_default_answers_on_the_device_as_on_the_cpu(served_default: Path, device_accepted: None) -> None:
    cpu = Bundle.load(served_default, device="cpu")
    want = served_answers(cpu)
    bundle = Bundle.load(served_default, device="cuda")
    assert bundle.device == "cuda" and bundle.text.device == "cuda", "MiniLM runs on the device's providers"
    assert bundle.extractor.backbone.runtime == "onnx", "the int8 graph"
    assert bundle.extractor.backbone.device == "cuda", "its graphs run on the device's providers"
    got = served_answers(bundle)
    names = ("boxes", "features", "image fragments", "sentence fragments", "mask", "S_kl")
    for name, a, b in zip(names, want, got, strict=True):
        assert isinstance(b, np.ndarray), f"{name}: a Bundle hands back NumPy arrays"
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=name)
    assert math.isfinite(float(want[-1].sum())) and float(want[-1].max()) > 0
