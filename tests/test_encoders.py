"""The fragment encoders' options (global encoders for the whole image / whole sentence, input dropout), and the
runtime's NumPy encoders held to the torch modules' numbers for every kind."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fragsearch.commands.flags import add_region_flags, with_region_flags
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import ImageConfig, TextConfig, TrainConfig
from fragsearch.model.encoders import Encoders, ModelConfig
from fragsearch.model.fragments import SENTENCE_REL, WORD_REL, TextPipeline
from fragsearch.model.text import RelationVocab
from fragsearch.model.trees import SentenceTree, TreeBatch
from fragsearch.model.words import WordTable
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel, InputDropout, arrays, build_model
from fragsearch.training.train import make_run

IMG_DIM, WORD_DIM, H = 12, 4, 8


def _model(**kw: object) -> FragmentModel:
    torch.manual_seed(0)
    cfg = ModelConfig(h=H, n_relations=3, img_dim=IMG_DIM, word_dim=WORD_DIM, sentence_relation=2, **kw)  # type: ignore[arg-type]
    return FragmentModel(cfg).eval()


def _sentences() -> tuple[torch.Tensor, ...]:
    pool = torch.randn(10, WORD_DIM)
    rel = torch.tensor([[0, 1, 2], [2, 0, 0]])  # relation 2 = the whole-sentence fragment
    a = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return pool, rel, a, a, mask


def test_global_encoders_touch_only_the_whole_image_and_whole_sentence() -> None:
    m = _model(global_hidden=16)
    assert m.global_image is not None and m.global_sentence is not None
    feats = torch.randn(2, 5, IMG_DIM)
    pool, rel, a, b, mask = _sentences()
    with torch.no_grad():
        img0, sent0 = m.embed_images(feats), m.embed_sentences(pool, rel, a, b, mask)
        for p in [*m.global_image.parameters(), *m.global_sentence.parameters()]:
            p.add_(torch.randn_like(p))
        img1, sent1 = m.embed_images(feats), m.embed_sentences(pool, rel, a, b, mask)
    assert not torch.allclose(img0[:, 0], img1[:, 0])  # whole image: the global encoder
    assert torch.equal(img0[:, 1:], img1[:, 1:])  # regions: the paper's linear encoder
    assert torch.equal(img0[:, 1:], m.image(feats[:, 1:]))
    whole = rel == 2
    assert not torch.allclose(sent0[whole], sent1[whole])
    assert torch.equal(sent0[~whole], sent1[~whole])  # triplets (and padding) unchanged
    assert torch.equal(sent1[1, 1:], torch.zeros(2, H))  # padding still zero
    assert (sent1 >= 0).all()  # sentence fragments stay ReLU'd


def test_without_options_the_model_is_the_papers() -> None:
    m = _model()
    assert m.global_image is None and m.global_sentence is None
    feats = torch.randn(2, 5, IMG_DIM)
    pool, rel, a, b, mask = _sentences()
    with torch.no_grad():
        img = m.embed_images(feats)
        sent = m.embed_sentences(pool, rel, a, b, mask)
        x = torch.cat([pool[a[0, 0]], pool[b[0, 0]]])
        expect = torch.relu(x @ m.w_rel[0] + m.b_rel[0])
    assert torch.allclose(img, m.image(feats))
    assert torch.allclose(sent[0, 0], expect)


def test_input_dropout_acts_only_while_training() -> None:
    m = _model(input_dropout=0.5)
    plain = _model()
    plain.load_state_dict(m.state_dict())
    feats = torch.randn(2, 5, IMG_DIM)
    pool, rel, a, b, mask = _sentences()
    with torch.no_grad():
        assert torch.equal(m.embed_images(feats), plain.embed_images(feats))
        assert torch.equal(m.embed_sentences(pool, rel, a, b, mask), plain.embed_sentences(pool, rel, a, b, mask))
        m.train()
        assert not torch.allclose(m.embed_images(feats), plain.embed_images(feats))


def test_input_dropout_draws_on_the_host_with_dropouts_rule_and_follows_torchs_seed() -> None:
    x = torch.rand(200, 50, 40) + 1.0
    torch.manual_seed(3)
    drop = InputDropout(0.2).train()
    y = drop(x)
    kept = y != 0
    assert abs(1.0 - float(kept.float().mean()) - 0.2) < 0.005  # each element zeroed with probability p
    assert torch.allclose(y[kept], x[kept] / 0.8)  # the others scaled by 1 / (1 - p)
    torch.manual_seed(3)
    assert torch.equal(InputDropout(0.2).train()(x), y)  # the same torch seed draws the same masks
    assert torch.equal(drop.eval()(x), x)
    x.requires_grad_(True)
    drop.train()(x).sum().backward()  # the gradient passes the kept elements only, scaled
    assert x.grad is not None and set(torch.unique(x.grad).tolist()) <= {0.0, 1.25}
    meta = torch.empty(4, 3, device="meta")  # another device: torch's own dropout, where the tensor is
    assert InputDropout(0.5).train()(meta).device.type == "meta"
    with pytest.raises(ValueError, match="dropout probability"):
        InputDropout(1.0)


def test_the_optimizer_step_is_fused_on_the_cpu_and_per_tensor_on_other_devices() -> None:
    from fragsearch.training.epochs import optimizer

    for name in ("adam", "sgd"):
        cfg = TrainConfig(optimizer=name)
        cpu = optimizer(cfg, list(_model().parameters()))
        assert cpu.defaults["fused"] is True
        meta = optimizer(cfg, list(_model().to("meta").parameters()))
        assert not meta.defaults["fused"]


def test_checkpoint_with_global_encoders_round_trips(tmp_path: Path) -> None:
    words = WordTable(["dog", "grass"], np.random.default_rng(0).normal(size=(2, WORD_DIM)).astype(np.float32))
    text_cfg = TextConfig(sentence_fragment=True)
    rels = RelationVocab(TextPipeline.relation_names(text_cfg, ["nsubj"]), {"nsubj": 3}, 0.01)
    sid = rels.index(SENTENCE_REL)
    assert sid is not None and rels.index(WORD_REL) is not None
    model = FragmentModel(ModelConfig(h=H, n_relations=len(rels.kept), img_dim=IMG_DIM, word_dim=WORD_DIM,
                                      global_hidden=16, sentence_relation=sid, input_dropout=0.2)).eval()
    ckpt = Checkpoint(model, TextPipeline(text_cfg, rels, words), ImageConfig())
    ckpt.save(tmp_path / "m.pt")
    again = Bundle.load(tmp_path / "m.pt")
    assert again.cfg == ckpt.cfg
    feats = np.random.default_rng(1).normal(size=(3, 20, IMG_DIM)).astype(np.float32)
    assert np.array_equal(again.embed_images(feats), ckpt.embed_images(feats))
    again.save(tmp_path / "exported")  # the runtime's form holds the same model
    exported = Bundle.load(tmp_path / "exported")
    assert np.array_equal(exported.embed_images(feats), ckpt.embed_images(feats))
    assert Checkpoint.load(tmp_path / "exported").cfg == ckpt.cfg


def test_model_options_reach_the_run_from_variant_and_flags() -> None:
    run = make_run("full", {}, {"global_hidden": 64, "input_dropout": 0.1})
    assert run.model_overrides["global_hidden"] == 64
    assert run.model_overrides["input_dropout"] == 0.1
    assert run.train.h == 512  # the variant's own model settings are kept
    with pytest.raises(ValueError, match="unknown variant"):
        make_run("no-such-variant", {})


def test_full_variants_differ_only_in_image_features() -> None:
    full, crop, roi = make_run("full", {}), make_run("full-crop", {}), make_run("full-roi", {})
    assert (full.image.region_features, crop.image.region_features, roi.image.region_features) == (
        "crop", "crop", "roi_align")
    assert dataclasses.replace(crop.image, region_features="roi_align") == roi.image
    assert dataclasses.replace(full.image, backbone_precision="fp32", proposal_resize=crop.image.proposal_resize,
                               backbone_size=crop.image.backbone_size) == crop.image
    assert full.image.backbone_precision == "int8" and crop.image.backbone_precision == "fp32"
    for other in (crop, roi):
        assert (full.train, full.text, full.model_overrides) == (other.train, other.text, other.model_overrides)
    assert full.train.calibrate == 1000


def test_region_flags_override_only_what_is_given() -> None:
    ap = argparse.ArgumentParser()
    add_region_flags(ap)
    run = make_run("full-crop", {})
    assert with_region_flags(run.image, ap.parse_args([])) == run.image
    roi = with_region_flags(run.image, ap.parse_args(["--region-features", "roi_align"]))
    assert roi == make_run("full-roi", {}).image
    int8 = with_region_flags(run.image, ap.parse_args(["--backbone-precision", "int8", "--proposal-resize", "112",
                                                       "--backbone-size", "224"]))
    assert int8 == make_run("full", {}).image
    assert with_region_flags(ImageConfig(), ap.parse_args(["--crop-size", "160"])).crop_size == 160


def test_the_train_step_bench_turns_both_choices_off_in_its_before_arm() -> None:
    import fragsearch.training.nets.encoders as encoders
    from bench.train_step import ARMS, arm
    from fragsearch.training.epochs import optimizer

    cpu = torch.device("cpu")
    with arm(ARMS[0]):
        assert not optimizer(TrainConfig(), list(_model().parameters())).defaults["fused"]
        assert not encoders.host_masks(cpu)
    with arm(ARMS[1]):
        assert optimizer(TrainConfig(), list(_model().parameters())).defaults["fused"] is True
        assert encoders.host_masks(cpu)


KIND_SHAPES = {
    "fragment": {},
    "fragment-hidden": {"image_hidden": 16},
    "fragment-global": {"global_hidden": 16},
    "two-branch": {"kind": "two-branch", "hidden": 16},
    "dt-rnn": {"kind": "dt-rnn", "tree_left": 2, "tree_right": 1},
    "sdt-rnn": {"kind": "sdt-rnn"},
    "devise": {"kind": "devise", "h": WORD_DIM},
}


def _trees() -> list[SentenceTree]:
    """Three small parse trees over pool rows 0..9 (one word without a vector, one empty sentence)."""
    return [SentenceTree.build([1, 2, 3, 4], [1, -1, 1, 2], [0, 1, 2, 0], root_rel=1),
            SentenceTree.build([5, -1, 6], [-1, 0, 0], [1, 2, 0], root_rel=1),
            SentenceTree.build([], [], [], root_rel=1)]


@pytest.mark.parametrize("name", sorted(KIND_SHAPES))
def test_the_runtimes_numpy_encoders_give_the_torch_modules_numbers(name: str) -> None:
    """The service embeds with NumPy (model/encoders.py) what training optimised as torch modules
    (training/nets/encoders.py): the same weights give the same fragments to float rounding, for every kind and
    option, batch norm's running statistics and padding included."""
    torch.manual_seed(0)
    shape = dict(KIND_SHAPES[name])
    cfg = ModelConfig(**{"h": H, "n_relations": 3, "img_dim": IMG_DIM, "word_dim": WORD_DIM,
                         "sentence_relation": 2, **shape})  # type: ignore[arg-type]
    model = build_model(cfg)
    model.train()  # move batch norm's running statistics off their initial values
    for p in model.parameters():
        p.data.normal_()
    if cfg.kind == "two-branch":
        with torch.no_grad():
            for _ in range(3):
                model.embed_images(torch.randn(16, IMG_DIM) * 3 + 1)
                model.embed_text(torch.randn(16, WORD_DIM) * 2 - 1)
    model.eval()
    enc = Encoders(cfg, arrays(model))
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(10, WORD_DIM)).astype(np.float32)
    with torch.no_grad():
        if cfg.kind == "fragment":
            feats = rng.normal(size=(3, 5, IMG_DIM)).astype(np.float32)
            want_img = model.embed_images(torch.from_numpy(feats)).numpy()
            _, rel, a, b, mask = _sentences()
            want = model.embed_sentences(torch.from_numpy(pool), rel, a, b, mask).numpy()
            got = enc.embed_fragments(pool, rel.numpy(), a.numpy(), b.numpy(), mask.numpy())
        else:
            feats = rng.normal(size=(4, IMG_DIM)).astype(np.float32)
            want_img = model.embed_images(torch.from_numpy(feats)).numpy()
            if cfg.kind == "two-branch":
                vecs = rng.normal(size=(4, WORD_DIM)).astype(np.float32)
                want, got = model.embed_text(torch.from_numpy(vecs)).numpy(), enc.embed_text(vecs)
            else:
                batch = TreeBatch.of(_trees())
                want = model.embed_sentences(torch.from_numpy(pool), batch.to("cpu")).numpy()
                got = enc.embed_trees(pool, batch)
    np.testing.assert_allclose(enc.embed_images(feats), want_img, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert set(enc.arrays()) <= set(model.state_dict())


def test_encoders_refuse_weights_of_another_shape() -> None:
    cfg = ModelConfig(h=H, n_relations=2, img_dim=IMG_DIM, word_dim=WORD_DIM)
    weights = arrays(build_model(cfg))
    with pytest.raises(ValueError, match="w_rel.1"):
        Encoders(cfg, {k: v for k, v in weights.items() if k != "w_rel.1"})
    with pytest.raises(ValueError, match="image.weight"):
        Encoders(dataclasses.replace(cfg, img_dim=IMG_DIM + 1), weights)
