"""Every objective, encoder, scoring, training and image-fragment path on a device other than the CPU,
without a GPU.

`tests.other_device` makes `cuda` a device whose tensors hold CPU data but are checked as CUDA checks
them: a tensor made without `device=` and mixed with the model's, or a `.numpy()` of a device
tensor, fails here as it would on a GPU. Each path runs on that device and on the CPU, and both
answers must agree. (The same paths on a real GPU: tests/test_gpu.py.)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

import fragsearch.model.backbone
import fragsearch.training.train
from fragsearch.model.calibration import Calibration
from fragsearch.model.config import ImageConfig, TextConfig
from fragsearch.model.data import Split
from fragsearch.model.dataset import SplitData
from fragsearch.model.encoders import GLOBAL_KINDS, ModelConfig
from fragsearch.model.fragments import TextPipeline, pad
from fragsearch.model.image import RegionExtractor
from fragsearch.model.parsers import make_parser
from fragsearch.model.score import (
    FlatFragments,
    align,
    flatten,
    fragment_scores,
    pair_contributions,
    skl,
    skl_from_flat,
)
from fragsearch.model.text import RelationVocab
from fragsearch.model.trees import SentenceTree, TreeBatch
from fragsearch.model.words import WORD_DIM, WordTable
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import DeViSE, FragmentModel, TreeRNN, TwoBranch, build_model
from fragsearch.training.objectives import fragment_loss, global_loss, mil_labels, two_branch_loss
from fragsearch.training.train import make_run, train
from tests.other_device import DeviceMixError, on_device, other_device

H, IMG_DIM = 16, 24
WORDS = ["a", "dog", "runs", "on", "the", "grass", "red", "ball", "man", "plays", "with", "cat", "sits", "water"]
SENTENCES = ["a red dog runs on the grass", "a man plays with a ball", "the cat sits on the water"]
RELATIONS = ["det", "amod", "nsubj", "prep_on", "prep_with", "dobj"]
IMAGE_CFG = ImageConfig(n_regions=4, backbone_size=224, proposal_resize=128, max_proposals=20)


def on_both(compute: Callable[[torch.device], object]) -> tuple[object, object]:
    """`compute(device)` on the CPU and on the other device; the device answer brought back to the CPU."""
    cpu = compute(torch.device("cpu"))
    with other_device() as dev:
        there = compute(dev)
        back = _to_cpu(there)
    return cpu, back


def _to_cpu(out: object) -> object:
    if isinstance(out, torch.Tensor):
        assert on_device(out), "a result came back on the CPU: the computation did not stay on the device"
        return out.detach().cpu()
    if isinstance(out, tuple | list):
        return type(out)(_to_cpu(o) for o in out)
    return out


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        torch.testing.assert_close(b, a.detach(), rtol=1e-5, atol=1e-6)
    elif isinstance(a, tuple | list):
        assert isinstance(b, tuple | list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


# -- the harness itself -------------------------------------------------------------------------------
def test_the_other_device_fails_where_cuda_would() -> None:
    with other_device() as dev:
        x = torch.ones(3, 2, device=dev)
        assert x.device == dev and on_device(x) and on_device(x + 1)
        with pytest.raises(DeviceMixError, match="same device"):
            x + torch.ones(3, 2)  # a CPU tensor of one or more dimensions
        assert on_device(x * torch.tensor(2.0))  # a CPU scalar is allowed, as CUDA allows it
        assert on_device(x[torch.tensor([0, 2])])  # so are CPU indices into a device tensor
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        back = x.cpu()
        assert back.device.type == "cpu" and not on_device(back) and back.numpy().shape == (3, 2)
        layer = torch.nn.Linear(2, 1).to(dev)
        assert all(on_device(p) and isinstance(p, torch.nn.Parameter) for p in layer.parameters())
        layer(x).sum().backward()
        assert layer.weight.grad is not None
        with pytest.raises(DeviceMixError):
            layer(torch.ones(3, 2))


# -- objectives ---------------------------------------------------------------------------------------
def _batch(dev: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of 3 images (4 fragments, the last image's 4th padding) and 5 sentences (3 fragments)."""
    g = torch.Generator().manual_seed(seed)
    pair_image = torch.tensor([0, 0, 1, 2, 2])
    img_mask = torch.ones(3, 4)
    img_mask[2, 3] = 0
    sent_mask = torch.ones(5, 3)
    sent_mask[1, 2] = 0
    cpu = {"img": torch.randn(3, 4, H, generator=g), "img_mask": img_mask,
           "sent": torch.randn(5, 3, H, generator=g).relu(), "sent_mask": sent_mask,
           "pair_image": pair_image, "pos": pair_image[None, :] == torch.arange(3)[:, None],
           "img_global": F.normalize(torch.randn(3, H, generator=g), dim=-1),
           "txt_global": F.normalize(torch.randn(5, H, generator=g), dim=-1)}
    return {k: v.to(dev) for k, v in cpu.items()}


OBJECTIVES: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "mil_labels dense": lambda b: mil_labels(_flat(b).scores, b["pos"][_flat(b).img_of][:, _flat(b).sent_of], False),
    "mil_labels MIL": lambda b: mil_labels(_flat(b).scores, b["pos"][_flat(b).img_of][:, _flat(b).sent_of], True),
    "fragment C_0": lambda b: fragment_loss(_flat(b), b["pos"], mil=False),
    "fragment C_F": lambda b: fragment_loss(_flat(b), b["pos"], mil=True),
    "fragment unbalanced": lambda b: fragment_loss(_flat(b), b["pos"], mil=True, balanced=False),
    "global C_G": lambda b: global_loss(skl_from_flat(_flat(b)), b["pos"], b["pair_image"], 0.1),
    "global top-k": lambda b: global_loss(skl_from_flat(_flat(b)), b["pos"], b["pair_image"], 0.1, top_k=1),
    "DeViSE hinge rank": lambda b: global_loss(b["img_global"] @ b["txt_global"].T, b["pos"], b["pair_image"], 0.1,
                                               rank_images=False),
    "two-branch": lambda b: two_branch_loss(b["img_global"], b["txt_global"], b["pos"], b["pair_image"], top_k=2),
}


def _flat(b: dict[str, torch.Tensor]) -> FlatFragments:
    return flatten(b["img"], b["img_mask"], b["sent"], b["sent_mask"])


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_objective_runs_on_another_device_with_its_gradient(name: str) -> None:
    def compute(dev: torch.device) -> tuple[torch.Tensor, ...]:
        batch = _batch(dev)
        for k in ("img", "sent", "img_global", "txt_global"):
            batch[k].requires_grad_(True)
        out = OBJECTIVES[name](batch)
        if not out.is_floating_point() or out.dim():  # labels: no gradient
            return (out,)
        out.backward()
        grads = (batch[k].grad for k in ("img", "sent", "img_global", "txt_global"))
        return out, *(g if g is not None else torch.zeros((), device=dev) for g in grads)

    cpu, there = on_both(compute)
    assert_same(cpu, there)


# -- encoders -----------------------------------------------------------------------------------------
ENCODERS = {
    "fragment": ModelConfig(h=H, img_dim=IMG_DIM, word_dim=8, n_relations=3),
    "fragment, hidden layers": ModelConfig(h=H, img_dim=IMG_DIM, word_dim=8, n_relations=3, image_hidden=12,
                                           global_hidden=12, sentence_relation=2),
    "two-branch": ModelConfig(kind="two-branch", h=H, img_dim=IMG_DIM, word_dim=8, hidden=12),
    "dt-rnn": ModelConfig(kind="dt-rnn", h=H, img_dim=IMG_DIM, word_dim=8, n_relations=3, tree_left=1, tree_right=1),
    "sdt-rnn": ModelConfig(kind="sdt-rnn", h=H, img_dim=IMG_DIM, word_dim=8, n_relations=3),
    "devise": ModelConfig(kind="devise", h=8, img_dim=IMG_DIM, word_dim=8),
}


def _trees() -> list[SentenceTree]:
    """"dog runs on grass" (runs the root, two left/right children) and a two-word sentence with one
    word outside the pool (-1), and an empty sentence."""
    return [SentenceTree.build([0, 1, 2, 3], [1, -1, 1, 2], [0, 1, 2, 1], 1),
            SentenceTree.build([4, -1], [-1, 0], [0, 2], 1),
            SentenceTree.build([], [], [], 1)]


@pytest.mark.parametrize("name", list(ENCODERS))
def test_encoder_runs_on_another_device(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(ENCODERS[name]).eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 5, IMG_DIM, generator=g)
    pool = torch.randn(6, 8, generator=g)
    rel, a = torch.tensor([[0, 1, 2], [2, 0, 0]]), torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])

    def compute(dev: torch.device) -> tuple[torch.Tensor, ...]:
        m = copy.deepcopy(model).to(dev)
        with torch.no_grad():
            if isinstance(m, FragmentModel):
                return m.embed_images(feats.to(dev)), m.embed_sentences(*(t.to(dev) for t in (pool, rel, a, a, mask)))
            images = m.embed_images(feats[:, 0].to(dev))
            if isinstance(m, TwoBranch):
                return images, m.embed_text(pool.to(dev))
            assert isinstance(m, TreeRNN | DeViSE)
            return images, m.embed_sentences(pool.to(dev), TreeBatch.of(_trees(), dev))

    cpu, there = on_both(compute)
    assert_same(cpu, there)


def test_global_kinds_are_all_covered() -> None:
    assert {c.kind for c in ENCODERS.values()} == {"fragment", *GLOBAL_KINDS}


# -- scoring ------------------------------------------------------------------------------------------
SCORING: dict[str, Callable[[dict[str, torch.Tensor]], object]] = {
    "skl": lambda b: skl(b["img"], b["img_mask"], b["sent"], b["sent_mask"]),
    "skl in chunks": lambda b: skl(b["img"], b["img_mask"], b["sent"], b["sent_mask"], chunk=2),
    "fragment_scores": lambda b: fragment_scores(b["img"], b["sent"]),
    "pair_contributions": lambda b: pair_contributions(b["img"][0], b["sent"][0]),
    "align": lambda b: tuple(vars(align(b["img"][0], b["sent"][0])).values()),
    "calibration scales": lambda b: _calibration(b).image_scales(b["img"]),
    "calibration sentence scales": lambda b: _calibration(b).sentence_scales(b["sent"], b["sent_mask"]),
}


def _calibration(b: dict[str, torch.Tensor]) -> Calibration:
    """References on the batch's device (a trainer fitting scales on its device holds them there)."""
    g = torch.Generator().manual_seed(5)
    dev = b["img"].device
    return Calibration(torch.randn(4, 3, H, generator=g).to(dev), torch.randn(6, 2, H, generator=g).relu().to(dev),
                       torch.ones(6, 2).to(dev))


@pytest.mark.parametrize("name", list(SCORING))
def test_scoring_runs_on_another_device(name: str) -> None:
    cpu, there = on_both(lambda dev: SCORING[name](_batch(dev)))
    assert_same(cpu, there)


# -- the runtime against the modules on the device ------------------------------------------------------
@pytest.fixture(scope="module")
def words() -> WordTable:
    return WordTable(WORDS, np.random.default_rng(0).standard_normal((len(WORDS), WORD_DIM)).astype(np.float32))


def _checkpoint(kind: str, words: WordTable) -> Checkpoint:
    """An untrained model of `kind` on the CPU, calibrated when it is a fragment model."""
    cfg = TextConfig(fragments="tree") if kind in ("dt-rnn", "sdt-rnn", "devise") else \
        TextConfig(sentence_fragment=kind == "two-branch")
    relations = RelationVocab(TextPipeline.relation_names(cfg, RELATIONS), {}, 0.01)
    torch.manual_seed(0)
    h = WORD_DIM if kind == "devise" else H
    model = build_model(ModelConfig(kind=kind, h=h, img_dim=1280, word_dim=WORD_DIM, n_relations=len(relations),
                                    hidden=32, tree_left=3, tree_right=3))
    ckpt = Checkpoint(model.eval(), TextPipeline(cfg, relations, words), IMAGE_CFG)
    if kind == "fragment":
        rng = np.random.default_rng(3)
        ckpt.calibration = Calibration(rng.standard_normal((4, 5, H)).astype(np.float32),
                                       np.maximum(rng.standard_normal((6, 3, H)), 0).astype(np.float32),
                                       np.ones((6, 3), np.float32))
    return ckpt


@pytest.mark.parametrize("kind", ["fragment", *GLOBAL_KINDS])
def test_the_modules_on_the_device_embed_as_the_runtime_does(kind: str, words: WordTable) -> None:
    """The torch modules training moves to the device embed what the runtime's NumPy encoders embed from their
    weights (the service's path: model/bundle.py), images and sentences, for every kind."""
    ckpt = _checkpoint(kind, words)
    runtime = ckpt.bundle()
    enc = runtime.text.encode(SENTENCES)
    feats = np.random.default_rng(1).standard_normal((3, 5, 1280)).astype(np.float32)

    def compute(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        model = copy.deepcopy(ckpt.model).to(dev)
        with torch.inference_mode():
            if kind == "fragment":
                img = model.embed_images(torch.from_numpy(feats).to(dev))
                rel, a, b, mask = pad(enc)
                pool, a, b = runtime.text.pool_of(enc, a, b)
                sent = model.embed_sentences(*(torch.from_numpy(x).to(dev) for x in (pool, rel, a, b, mask)))
            else:
                img = model.embed_images(torch.from_numpy(feats[:, 0]).to(dev))
                if kind == "two-branch":
                    sent = model.embed_text(torch.from_numpy(enc.extra).to(dev))
                else:
                    assert enc.trees is not None
                    batch = TreeBatch.of(enc.trees)
                    pool, rows, _ = runtime.text.pool_of(enc, np.maximum(batch.rows, 0), batch.rows[:0])
                    sent = model.embed_sentences(torch.from_numpy(pool).to(dev), batch.with_rows(rows).to(dev))
        return img, sent

    cpu, there = on_both(compute)
    assert_same(cpu, there)
    img = runtime.embed_images(feats, calibrated=False)
    sent, mask = runtime.embed_sentences(enc, calibrated=False)
    want_img = there[0].numpy() if kind == "fragment" else there[0].numpy()[:, None]  # type: ignore[index]
    want_sent = there[1].numpy() if kind == "fragment" else there[1].numpy()[:, None]  # type: ignore[index]
    np.testing.assert_allclose(img, want_img, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sent, want_sent, rtol=1e-5, atol=1e-5)
    assert all(isinstance(x, np.ndarray) for x in (img, sent, mask))


# -- training -----------------------------------------------------------------------------------------
CAPTIONS = [("a red circle beside a blue square", "a red circle on the left"),
            ("a green triangle above a yellow square", "a small green triangle"),
            ("a blue square and a red circle", "two shapes: a blue square and a red circle"),
            ("a yellow circle", "one yellow circle on white")]


@pytest.fixture(scope="module")
def tiny_split(tmp_path_factory: pytest.TempPathFactory) -> SplitData:
    """Four images of random features and eight parsed captions."""
    split = Split(tmp_path_factory.mktemp("tiny"), tuple(f"{i}.jpg" for i in range(len(CAPTIONS))), tuple(CAPTIONS))
    sentences = [c for captions in CAPTIONS for c in captions]
    feats = np.random.default_rng(0).standard_normal((len(CAPTIONS), 5, 1280)).astype(np.float32)
    return SplitData(split, feats, np.zeros((len(CAPTIONS), 5, 4), np.float32), sentences,
                     np.repeat(np.arange(len(CAPTIONS)), 2), make_parser("spacy").parse(sentences))


@pytest.mark.parametrize("variant", ["paper", "two-branch", "dt-rnn", "sdt-rnn", "devise", "contextual-text1"])
def test_training_runs_on_another_device(variant: str, tiny_split: SplitData, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two epochs and the calibration of each model kind on the device: the CPU's losses and weights; and a
    model training its own top layer of MiniLM (their input, MiniLM cut below them, from the CPU run's cache).
    (The trainer checks that a GPU is there: here the device is the other one, so the check is told so;
    the word and sentence vectors come from the CPU run's cache, MiniLM stays on the CPU.)"""
    h = WORD_DIM if variant == "devise" else H
    name, shape = ("contextual", {"text_layers": 1}) if variant == "contextual-text1" else (variant, {})

    def run(device: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        cfg = make_run(name, {"epochs": 2, "dense_epochs": 1, "anneal_epochs": 1, "batch_size": 4, "h": h,
                              "device": device, "calibrate": 4, "text_lr": 1e-3}, shape)
        summary = train(cfg, tiny_split, None, tmp_path / device, tmp_path / "cache")
        state = torch.load(tmp_path / device / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
        return [e["loss"] for e in summary["history"]], state

    cpu_losses, cpu_state = run("cpu")
    monkeypatch.setattr(fragsearch.training.train, "device_name", str)
    with other_device():
        losses, state = run("cuda")
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    assert state.keys() == cpu_state.keys()
    for name, weights in cpu_state.items():
        torch.testing.assert_close(state[name], weights, rtol=1e-4, atol=1e-6)


# -- image fragments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("features", ["roi_align", "crop", "full frame"])
def test_image_extraction_runs_on_another_device(features: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The extractor made for the device (the backbone's device check is told the device is there): its graphs
    on ONNX Runtime's providers for it (the CPU's where onnxruntime-gpu is missing), proposals, objectness and
    region features in NumPy, no torch tensor anywhere: the CPU's regions and features."""
    cfg = dataclasses.replace(IMAGE_CFG, region_features="crop" if features == "crop" else "roi_align",
                              full_frame_only=features == "full frame")
    image = Image.new("RGB", (160, 120), (240, 240, 240))
    ImageDraw.Draw(image).ellipse((40, 30, 120, 90), fill=(200, 30, 30))
    cpu = RegionExtractor(cfg, "cpu").extract(image)
    monkeypatch.setattr(fragsearch.model.backbone, "resolve_device", str)
    with other_device():
        extractor = RegionExtractor(cfg, "cuda")
        assert extractor.backbone.runtime == "onnx" and extractor.backbone.device == "cuda"
        there = extractor.extract(image)
    np.testing.assert_array_equal(there.boxes, cpu.boxes)
    np.testing.assert_allclose(there.features, cpu.features, rtol=1e-5, atol=1e-5)
