"""Training on the coloured-shapes set: it learns, and model selection never looks at dev."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fragsearch.commands.flags import bool_flag
from fragsearch.commands.train import main as train_main
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import ImageConfig, TrainConfig
from fragsearch.model.dataset import SplitData, hold_out, load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.model.variants import VariantError
from fragsearch.training.epochs import _step, drop_fragments, global_top_k_at
from fragsearch.training.evaluate import evaluate
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import build_model
from fragsearch.training.train import Trained, split_for_selection, train_variant
from tests.conftest import ShapesModel


@pytest.fixture(scope="module")
def shapes_train(shapes_model: ShapesModel) -> SplitData:
    return load_split_data(shapes_model.data, "train", ImageConfig(), shapes_model.cache, make_parser("spacy"))


def test_training_lowers_the_loss_and_beats_the_untrained_model(shapes_model: ShapesModel) -> None:
    history = shapes_model.summary["history"]
    assert isinstance(history, list) and len(history) == 30
    # the loss changes definition at the switch from C_0 to MIL C_F (epoch 11): compare within each phase
    assert history[9]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["loss"] < history[10]["loss"]
    trained = shapes_model.bundle
    torch.manual_seed(0)
    untrained = Checkpoint(build_model(trained.cfg).eval(), trained.text, trained.image_cfg).bundle()
    before, after = evaluate(untrained, shapes_model.dev), evaluate(trained, shapes_model.dev)
    # 20 dev images: chance R-sum is about 2 * (5 + 25 + 50) = 160
    assert after["rsum"] > before["rsum"] + 100, (before["rsum"], after["rsum"])
    assert after["search_medr"] < before["search_medr"] and after["annot_medr"] < before["annot_medr"]


def test_held_out_part_is_image_disjoint_and_fixed(shapes_train: SplitData) -> None:
    rest, val = hold_out(shapes_train, 10, seed=0)
    assert len(val.names) == 10 and len(rest.names) == 50
    assert not set(val.names) & set(rest.names)
    assert sorted(val.names + rest.names) == sorted(shapes_train.names)
    for part in (rest, val):  # every image keeps all its captions, in order, with its own features
        assert len(part.sentences) == 5 * len(part.names) == len(part.parsed) == len(part.pair_image)
        for k, name in enumerate(part.names):
            src = shapes_train.names.index(name)
            own = [s for s, i in zip(shapes_train.sentences, shapes_train.pair_image, strict=True) if i == src]
            assert [s for s, i in zip(part.sentences, part.pair_image, strict=True) if i == k] == own
            assert np.array_equal(part.feats[k], shapes_train.feats[src])
    assert hold_out(shapes_train, 10, seed=0)[1].names == val.names
    assert hold_out(shapes_train, 10, seed=1)[1].names != val.names


def test_selection_settings(shapes_train: SplitData) -> None:
    rest, val = split_for_selection(TrainConfig(selection="val", val_images=12), shapes_train)
    assert val is not None and (len(rest.names), len(val.names)) == (48, 12)
    assert split_for_selection(TrainConfig(selection="last"), shapes_train) == (shapes_train, None)
    with pytest.raises(ValueError, match="cannot hold out 30 of 60"):
        split_for_selection(TrainConfig(val_images=30), shapes_train)
    with pytest.raises(SystemExit):
        train_main(["--dev-split", "dev"])  # dev never selects a model


@pytest.mark.parametrize("word", ["ture", "fasle", "y", "", "2"])
def test_a_misspelt_boolean_flag_is_refused(word: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--balanced ture` once trained with balanced = False without a word."""
    with pytest.raises(SystemExit) as stop:
        train_main(["--balanced", word, "--list"])
    assert stop.value.code == 2
    assert f"argument --balanced: {word!r} is not true or false" in capsys.readouterr().err


@pytest.mark.parametrize(("word", "value"), [("true", True), ("Yes", True), ("on", True), ("1", True),
                                             ("false", False), ("NO", False), ("off", False), ("0", False)])
def test_boolean_flag_words(word: str, value: bool) -> None:
    assert bool_flag(word) is value


def test_trainer_keeps_the_best_epoch_on_held_out_training_images(shapes_model: ShapesModel, tmp_path: Path) -> None:
    common = ["--data", str(shapes_model.data), "--cache", str(shapes_model.cache), "--variant", "paper",
              "--workers", "1", "--h", "16", "--batch-size", "20", "--dense-epochs", "1", "--anneal-epochs", "1",
              "--lr", "3e-3"]
    train_main([*common, "--out", str(tmp_path / "val"), "--epochs", "4", "--eval-every", "1", "--val-images", "10",
                "--calibrate", "10"])
    summary = json.loads((tmp_path / "val" / "history.json").read_text())
    assert summary["selection"]["rule"] == "val" and summary["selection"]["images"] == 10
    assert (summary["train_images"], summary["train_sentences"]) == (50, 250)  # the 10 are not trained on
    rsums = [h["val_rsum"] for h in summary["history"]]
    assert len(rsums) == 4 and not any("rsum" in h for h in summary["history"])
    kept = summary["selection"]["epoch"]
    assert kept == 1 + int(np.argmax(rsums))  # the first of the best
    meta = Bundle.load(tmp_path / "val" / "model.pt").meta
    assert meta["selection"]["epoch"] == kept and meta["selection"]["val"]["rsum"] == max(rsums)
    assert meta["selection"]["val"]["images"] == 10 and "dev" not in meta
    # the relevance scale of the kept epoch's calibrated score, fitted on the same held-out images
    kept_bundle = Bundle.load(tmp_path / "val" / "model.pt")
    assert kept_bundle.relevance is not None and kept_bundle.relevance.slope > 0
    assert meta["calibration"]["relevance"]["images"] == 10
    # the old spelling of a fixed epoch count: every training image, the last epoch
    train_main([*common, "--out", str(tmp_path / "last"), "--epochs", "2", "--dev-split", ""])
    summary = json.loads((tmp_path / "last" / "history.json").read_text())
    assert summary["selection"] == {"rule": "last", "epochs": 2, "epoch": 2} and summary["train_images"] == 60
    assert Bundle.load(tmp_path / "last" / "model.pt").meta["selection"]["epoch"] == 2


def test_a_step_clips_the_gradient_norm_when_asked() -> None:
    def moved(clip: float) -> float:
        w = torch.nn.Parameter(torch.zeros(4))
        opt = torch.optim.SGD([w], lr=1.0)
        loss = (w * torch.tensor([30.0, 40.0, 0.0, 0.0])).sum()  # gradient norm 50
        assert _step(opt, loss, clip) == 0.0
        return float(w.detach().norm())

    assert moved(0.0) == pytest.approx(50.0)  # off: the plain SGD step
    assert moved(5.0) == pytest.approx(5.0)  # the step of lr 1 is the clipped gradient


def test_train_variant_trains_a_variant_as_its_file_gives_it(shapes_model: ShapesModel, tmp_path: Path) -> None:
    """The typed entry a first start calls: the variant's own settings, the selection asked, the command
    that reproduces the run in its history."""
    out = tmp_path / "paper"
    trained = train_variant("paper", shapes_model.data, out, "last", cache=shapes_model.cache, workers=1, limit=20)
    assert trained == Trained("paper", out / "model.pt", "last", 10, 10, trained.seconds) and trained.seconds > 0
    assert Bundle.load(trained.checkpoint).meta["variant"] == "paper"
    summary = json.loads((out / "history.json").read_text())
    assert summary["selection"] == {"rule": "last", "epochs": 10, "epoch": 10} and summary["train_images"] == 20
    assert summary["command"] == (f"python -m fragsearch.training.train --data {shapes_model.data} --variant paper "
                                  f"--out {out} "
                                  f"--cache {shapes_model.cache} --workers 1 --device auto --selection last "
                                  "--train-limit 20")
    with pytest.raises(VariantError, match="unknown variant 'no-such'"):
        train_variant("no-such", shapes_model.data, tmp_path / "none", "last", cache=shapes_model.cache)
    assert not (tmp_path / "none").exists()


def test_drop_fragments_keeps_no_padding_and_at_least_one_real_fragment_per_item() -> None:
    mask = torch.zeros(400, 12)
    lengths = np.random.default_rng(1).integers(1, 13, size=400)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rng = np.random.default_rng(0)
    kept = drop_fragments(mask, 0.2, rng)
    assert kept.dtype == mask.dtype and kept.shape == mask.shape
    assert bool((kept <= mask).all())  # padding never comes back
    assert bool((kept.sum(1) >= 1).all())
    share = float(kept.sum() / mask.sum())
    assert 0.75 < share < 0.85  # about 1 - p of the real fragments (single-fragment items always keep theirs)
    every = drop_fragments(mask, 1.0, rng)
    assert bool((every.sum(1) == 1).all()) and bool((every <= mask).all())  # p = 1: one drawn per item
    assert torch.equal(drop_fragments(mask, 0.0, rng), mask)


def test_max_violation_takes_over_from_its_epoch() -> None:
    warm = TrainConfig(global_top_k=5, max_violation_from=5)
    assert [global_top_k_at(warm, e) for e in range(8)] == [5, 5, 5, 5, 1, 1, 1, 1]
    assert [global_top_k_at(TrainConfig(global_top_k=5), e) for e in range(3)] == [5, 5, 5]
    assert global_top_k_at(TrainConfig(global_top_k=0, max_violation_from=1), 0) == 1


def test_mirrored_views_show_each_image_as_one_view_or_the_other() -> None:
    from fragsearch.training.epochs import MirroredViews

    feats, mirrored = torch.zeros(50, 3, 4), torch.ones(50, 3, 4)
    idx = torch.arange(50)
    assert torch.equal(MirroredViews(feats, mirrored, 0.0, np.random.default_rng(0))[idx], feats)
    assert torch.equal(MirroredViews(feats, mirrored, 1.0, np.random.default_rng(0))[idx], mirrored)
    views = MirroredViews(feats, mirrored, 0.5, np.random.default_rng(0))
    shown = torch.stack([views[idx] for _ in range(20)])  # (draws, images, F, D)
    per_image = shown.mean(dim=(2, 3))
    assert bool(((per_image == 0) | (per_image == 1)).all())  # every fragment of an image from one view
    assert 0.4 < float(per_image.mean()) < 0.6 and bool((per_image.std(dim=0) > 0).all())  # drawn anew each read
    with pytest.raises(ValueError, match="mirrored view"):
        MirroredViews(feats, torch.ones(50, 2, 4), 0.5, np.random.default_rng(0))


def test_training_on_mirrored_views_extracts_them_for_the_trained_images_only(shapes_model: ShapesModel,
                                                                              tmp_path: Path) -> None:
    """--mirror-views: the images trained on get their mirrored view in a cache folder of its own (the
    validation part is not mirrored), and the checkpoint's image settings stay those it serves with."""
    from fragsearch.model.dataset import feature_cache

    cache = tmp_path / "cache"
    out = tmp_path / "mirror"
    train_main(["--data", str(shapes_model.data), "--cache", str(cache), "--variant", "paper", "--workers", "1",
                "--region-features", "crop", "--h", "16", "--batch-size", "20", "--epochs", "2", "--dense-epochs",
                "1", "--anneal-epochs", "1", "--train-limit", "24", "--val-images", "4", "--eval-every", "1",
                "--mirror-views", "0.5", "--out", str(out)])
    summary = json.loads((out / "history.json").read_text())
    assert summary["config"]["train"]["mirror_views"] == 0.5 and summary["train_images"] == 20
    bundle = Bundle.load(out / "model.pt")
    assert bundle.image_cfg.mirror is False
    plain = feature_cache(cache, bundle.image_cfg)
    mirrored = feature_cache(cache, dataclasses.replace(bundle.image_cfg, mirror=True))
    assert plain.dir != mirrored.dir
    assert len(list(plain.dir.glob("*.npz"))) == 24 and len(list(mirrored.dir.glob("*.npz"))) == 20
