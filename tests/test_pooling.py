"""S_kl pooled over ranks (ModelConfig.pool_ranks, model/score.py): the mean's S_kl at equal weights, a max
at a one-hot weight, the same numbers from NumPy and torch, learned by the
trainer's model, carried by the runtime's encoders and the calibration, and refused by the index."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fragsearch.index.images import ImageIndex
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Calibration
from fragsearch.model.dataset import load_split_data
from fragsearch.model.encoders import Encoders, ModelConfig
from fragsearch.model.parsers import make_parser
from fragsearch.model.score import skl
from fragsearch.training.evaluate import evaluate
from fragsearch.training.nets.encoders import FragmentModel, arrays
from fragsearch.training.train import make_run, train
from tests.conftest import ShapesModel

F, H = 6, 8


def _batch(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    img = rng.normal(size=(5, F, H)).astype(np.float32)
    sent = rng.normal(size=(4, 3, H)).astype(np.float32)
    img_mask = np.ones((5, F), np.float32)
    sent_mask = np.ones((4, 3), np.float32)
    sent_mask[1, 2] = 0
    sent_mask[3, 1:] = 0
    return img, img_mask, sent, sent_mask


@pytest.mark.parametrize("blocks", [1, 2])
def test_equal_weights_are_the_means_skl(blocks: int) -> None:
    img, im, sent, sm = _batch()
    np.testing.assert_allclose(skl(img, im, sent, sm, blocks=blocks, pool=np.full(F, 1 / F, np.float32)),
                               skl(img, im, sent, sm, blocks=blocks), rtol=1e-5, atol=1e-7)


def test_a_one_hot_first_rank_is_each_sentence_fragments_best_image_fragment() -> None:
    img, im, sent, sm = _batch(1)
    first = np.zeros(F, np.float32)
    first[0] = 1
    best = np.maximum(np.einsum("kfh,lth->kflt", img, sent), 0).max(axis=1) * sm[None]  # (K, L, T)
    np.testing.assert_allclose(skl(img, im, sent, sm, pool=first), best.sum(-1) / (sm.sum(1)[None] + 5.0),
                               rtol=1e-5)


def test_weights_apply_to_ranks_not_to_fragment_positions() -> None:
    img, im, sent, sm = _batch(2)
    w = np.random.default_rng(3).dirichlet(np.ones(F)).astype(np.float32)
    shuffled = img[:, np.random.default_rng(4).permutation(F)]
    np.testing.assert_allclose(skl(shuffled, im, sent, sm, pool=w), skl(img, im, sent, sm, pool=w), rtol=1e-5)


def test_padded_images_or_another_count_of_ranks_are_refused() -> None:
    img, im, sent, sm = _batch()
    im[0, -1] = 0
    with pytest.raises(ValueError, match="no padding"):
        skl(img, im, sent, sm, pool=np.full(F, 1 / F, np.float32))
    with pytest.raises(ValueError, match="ranks"):
        skl(img, np.ones_like(im), sent, sm, pool=np.full(F + 1, 1 / (F + 1), np.float32))


def test_torch_gives_numpys_numbers_with_gradients_to_the_weights() -> None:
    img, im, sent, sm = _batch(5)
    w = np.random.default_rng(6).dirichlet(np.ones(F)).astype(np.float32)
    logits = torch.tensor(np.log(w), requires_grad=True)
    got = skl(*(torch.from_numpy(x) for x in (img, im, sent, sm)), pool=torch.softmax(logits, 0))
    np.testing.assert_allclose(got.detach().numpy(), skl(img, im, sent, sm, pool=w), rtol=1e-5)
    got.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_the_trainers_weights_reach_the_runtime_and_the_calibration() -> None:
    cfg = ModelConfig(img_dim=10, word_dim=4, h=H, pool_ranks=F)
    model = FragmentModel(cfg)
    with torch.no_grad():
        model.pool_logits.copy_(torch.arange(F, dtype=torch.float32))
    enc = Encoders(cfg, arrays(model))
    want = torch.softmax(torch.arange(F, dtype=torch.float32), 0).numpy()
    np.testing.assert_allclose(enc.pool, want, rtol=1e-6)
    assert Encoders(ModelConfig(img_dim=10, word_dim=4, h=H), {k: v for k, v in arrays(model).items()
                                                               if k != "pool_logits"}).pool is None
    with pytest.raises(ValueError, match="pool_logits"):
        Encoders(cfg, {k: v for k, v in arrays(model).items() if k != "pool_logits"})
    img, im, sent, sm = _batch(7)
    cal = Calibration(img, sent, sm, pool=enc.pool)
    np.testing.assert_allclose(cal.image_scores(img), skl(img, im, sent, sm, pool=enc.pool), rtol=1e-5)
    assert not np.allclose(cal.image_scores(img), skl(img, im, sent, sm), rtol=1e-3)


def test_a_pooled_model_trains_saves_and_evaluates_and_the_index_refuses_it(
        shapes_model: ShapesModel, tmp_path: Path) -> None:
    image = shapes_model.bundle.image_cfg
    run = make_run("paper", {"epochs": 4, "dense_epochs": 1, "anneal_epochs": 1, "batch_size": 20, "h": 32,
                             "lr": 3e-2, "eval_every": 0, "calibrate": 20}, {"pool_ranks": image.n_fragments})
    run = dataclasses.replace(run, image=image)
    parser = make_parser("spacy")
    train_data = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, parser)
    train(run, train_data, None, tmp_path / "model", shapes_model.cache)
    bundle = Bundle.load(tmp_path / "model" / "model.pt")
    assert bundle.pool is not None and bundle.pool.shape == (run.image.n_fragments,)
    assert not np.allclose(bundle.pool, 1 / run.image.n_fragments)  # the weights were trained
    assert bundle.calibration is not None and bundle.calibration.pool is not None
    metrics = evaluate(bundle, shapes_model.dev)
    assert 0 <= metrics["search_r1"] <= 100
    with pytest.raises(ValueError, match="pools over ranks"):
        ImageIndex.create(tmp_path / "index", bundle)


def test_pooled_members_are_not_merged() -> None:
    from fragsearch.training.merge import merge_models

    cfg = ModelConfig(img_dim=10, word_dim=4, h=H, pool_ranks=F)
    with pytest.raises(ValueError, match="pooled over ranks"):
        merge_models([FragmentModel(cfg), FragmentModel(cfg)])
