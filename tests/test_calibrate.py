"""Score calibration: per-item scales against reference sets, still the one S_kl."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Calibration, Relevance, competition
from fragsearch.model.score import align, skl
from fragsearch.training.calibrate import fit_calibration, per_item_ms
from fragsearch.training.evaluate import annotation_ranks, evaluate, score_split, search_ranks
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.relevance import (
    Judged,
    _fit,
    _logistic,
    alike_blocks,
    described_alike,
    fit_relevance,
    reliability,
    shown,
)
from tests.conftest import ShapesModel

SCALE = Relevance(3.0, 0.5, 20.0, -1.5, -1.0, 0.1, -0.2, -0.4)


def _random_calibration(h: int = 6, seed: int = 0) -> Calibration:
    g = torch.Generator().manual_seed(seed)
    ref_img = torch.randn(30, 4, h, generator=g)
    ref_sent = torch.randn(40, 3, h, generator=g).relu()
    mask = torch.ones(40, 3)
    mask[::3, 2] = 0
    return Calibration(ref_img, ref_sent * mask[..., None], mask, floor_image=1e-3, floor_sentence=1e-3)


def test_calibrated_score_is_skl_over_the_two_scales() -> None:
    cal = _random_calibration()
    g = torch.Generator().manual_seed(1)
    img, sent = torch.randn(5, 4, 6, generator=g), torch.randn(7, 3, 6, generator=g).relu()
    im, sm = torch.ones(5, 4), torch.ones(7, 3)
    sigma, tau = cal.image_scales(img), cal.sentence_scales(sent, sm)
    raw = skl(img, im, sent, sm)
    calibrated = skl(img / sigma[:, None, None], im, sent / tau[:, None, None], sm)
    assert torch.allclose(calibrated, raw / sigma[:, None] / tau[None, :], rtol=1e-5)
    # sigma_k: the spread of image k's S_kl over the reference sentences
    expect = skl(img, im, cal.ref_sentences, cal.ref_sentence_mask).std(dim=1, unbiased=False)
    assert torch.allclose(sigma, expect)
    # the image scale leaves annotation alone, the sentence scale leaves search alone
    pair = np.arange(7) % 5
    assert np.array_equal(annotation_ranks(calibrated.numpy(), pair), annotation_ranks((raw / tau).numpy(), pair))
    assert np.array_equal(search_ranks(calibrated.numpy(), pair),
                          search_ranks((raw / sigma[:, None]).numpy(), pair))
    # ... and no triplet changes the region it aligns to
    a = align(img[0], sent[0])
    b = align(img[0] / sigma[0], sent[0] / tau[0])
    assert a.image_fragment == b.image_fragment and a.matched == b.matched


def test_a_merged_models_blocks_are_calibrated_apart_on_their_own_reference_slices() -> None:
    """Each block's scale is its slice's spread against the references' same slice (the slices kept
    contiguous once, and the same answer every time)."""
    cal = _random_calibration()
    g = torch.Generator().manual_seed(2)
    img, sent = torch.randn(5, 4, 6, generator=g), torch.randn(7, 3, 6, generator=g).relu()
    im, sm = torch.ones(5, 4), torch.ones(7, 3)
    for _ in range(2):  # the second call reads the kept slices
        got = cal.calibrate_sentences(sent, sm, blocks=2)
        for part in (slice(0, 3), slice(3, 6)):
            ref = cal.ref_images[..., part]
            tau = skl(ref, torch.ones(ref.shape[:2]), sent[..., part], sm).std(dim=0, unbiased=False)
            want = sent[..., part] / tau.clamp_min(cal.floor_sentence)[:, None, None]
            torch.testing.assert_close(got[..., part], want)
            assert cal.reference("images", part).is_contiguous()
        got_img = cal.calibrate_images(img, blocks=2)
        ref_s = cal.ref_sentences[..., 3:6]
        sigma = skl(img[..., 3:6], im, ref_s, cal.ref_sentence_mask).std(dim=1, unbiased=False)
        torch.testing.assert_close(got_img[..., 3:6], img[..., 3:6] / sigma.clamp_min(cal.floor_image)[:, None, None])
    assert cal.reference("images", slice(None)) is cal.ref_images


def test_an_images_overall_scale_is_calibrated_away() -> None:
    """A hub (an image whose fragments score 10x higher against everything) ranks like its plain copy."""
    cal = _random_calibration()
    img = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(2))
    plain = img / cal.image_scales(img)[:, None, None]
    hub = 10 * img
    assert torch.allclose(hub / cal.image_scales(hub)[:, None, None], plain, rtol=1e-4)


def test_an_item_that_never_scores_gets_the_floor_not_a_division_by_zero() -> None:
    cal = _random_calibration()
    zero_img = torch.zeros(2, 4, 6)
    zero_sent = torch.zeros(1, 3, 6)
    assert torch.equal(cal.image_scales(zero_img), torch.full((2,), 1e-3))
    assert torch.equal(cal.sentence_scales(zero_sent, torch.ones(1, 3)), torch.full((1,), 1e-3))
    assert torch.isfinite(zero_img / cal.image_scales(zero_img)[:, None, None]).all()


def test_fit_on_the_shapes_model_and_round_trip(shapes_model: ShapesModel, tmp_path: Path) -> None:
    bundle = Bundle.load(shapes_model.model_path)
    dev = shapes_model.dev
    raw = evaluate(bundle, dev)
    bundle.calibration = fit_calibration(bundle, dev, refs=15, seed=0)
    assert bundle.calibration.ref_images.shape[0] == 15 and bundle.calibration.ref_sentences.shape[0] == 15
    assert bundle.calibration.floor_image > 0 and bundle.calibration.floor_sentence > 0
    cal = evaluate(bundle, dev)
    chance = 100 * (1 + 5 + 10) / len(dev.names) * 2
    assert cal["rsum"] > 2 * chance and raw["rsum"] > 2 * chance
    bundle.save(tmp_path / "m")
    again = Bundle.load(tmp_path / "m")
    assert again.calibration is not None
    enc = bundle.text.encode_parsed(dev.parsed, dev.sentences)
    a = score_split(bundle, dev.feats, enc)
    b = score_split(again, dev.feats, enc)
    uncal = bundle.scores(bundle.embed_images(dev.feats, calibrated=False), np.ones((len(dev.names), 20), np.float32),
                          *bundle.embed_sentences(enc, calibrated=False))
    np.testing.assert_allclose(b, a, rtol=2e-2, atol=1e-6)  # references are stored at half precision
    assert not np.allclose(a, uncal)


def test_per_item_cost_is_measured_for_both_sides_with_and_without_scales(shapes_model: ShapesModel) -> None:
    bundle = Bundle.load(shapes_model.model_path)
    bundle.calibration = fit_calibration(bundle, shapes_model.dev, refs=10, seed=1)
    cost = per_item_ms(bundle, shapes_model.dev, n=5)
    assert set(cost) == {"image", "image_calibrated", "sentence", "sentence_calibrated"}
    assert all(v > 0 for v in cost.values())


def _mixture_scores(rng: np.random.Generator, n_img: int, per: int, alike: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scores of a world where a non-match scores ~ N(0, 1), an image described alike ~ N(2.5, 1) (a share
    `alike` of the other pairs) and a sentence's own image ~ N(4, 1)."""
    pair = np.repeat(np.arange(n_img), per)
    cols = np.arange(len(pair))
    scores = rng.normal(0.0, 1.0, size=(n_img, len(pair)))
    matches = rng.random(scores.shape) < alike
    scores[matches] = rng.normal(2.5, 1.0, size=int(matches.sum()))
    matches[pair, cols] = True
    scores[pair, cols] = rng.normal(4.0, 1.0, size=len(pair))
    return scores, pair, matches


def _judged_world(seed: int, n_img: int = 1000, n_val: int = 300, alike: float = 0.01) -> Judged:
    """A world of `_mixture_scores` whose first `n_val` images (and their captions) are the validation part
    and the rest its distractors."""
    scores, pair, matches = _mixture_scores(np.random.default_rng(seed), n_img, 5, alike)
    lq = int(np.count_nonzero(pair < n_val))
    return Judged(scores[:, :lq], matches[:, :lq], scores[:n_val], matches[:n_val], pair, n_val)


def test_relevance_fit_is_calibrated_in_collections_of_any_size() -> None:
    """In a world of known scores the fitted relevance says how often a result shown is a match: in another
    draw of that world, collections smaller and larger than the validation part, both sides; it ranks as the
    score does for a query, and a score that says the opposite has no scale."""
    rel = fit_relevance(_judged_world(0))
    assert rel.slope >= 0 and rel.context >= 0 and rel.beta > 0
    world = _judged_world(1)
    for n in (100, 1000):
        images = np.arange(n)
        caps = np.flatnonzero(world.caption_image < n)
        for part in (shown(world.search[np.ix_(images, caps[caps < world.n_captions])].T,
                           world.search_matches[np.ix_(images, caps[caps < world.n_captions])].T, True),
                     shown(world.annotate[: min(n, world.n_images)][:, caps],
                           world.annotate_matches[: min(n, world.n_images)][:, caps], False)):
            p = part.relevance(rel)
            for row in reliability(p, part.match):
                if row["pairs"] >= 200:
                    assert abs(row["predicted"] - row["observed"]) < 0.1, (n, row)
    one = rel.for_query("search", world.search[:, 0])
    grid = np.linspace(-1.0, 6.0, 15)
    assert np.all(np.diff(one(grid)) > 0)  # a monotone map of the score: rankings stay
    only_own = fit_relevance(_judged_world(2, alike=0.0))  # a caption's own image alone is a match: the more
    assert only_own.context > 0  # images near the top, the less likely a result is the one
    own = world.search  # each caption's own image (image 0 for the first five) among 50 images, then 1,000
    small, large = ([only_own.for_query("search", own[:n, c]).of(own[0, c]) for c in range(5)] for n in (50, 1000))
    assert all(a >= b for a, b in zip(small, large, strict=True)) and sum(small) > sum(large)
    with pytest.raises(ValueError, match="no relevance scale"):
        flipped = _judged_world(0)
        fit_relevance(replace(flipped, search=-flipped.search, annotate=-flipped.annotate))


def test_a_score_that_adds_nothing_beside_its_competition_leaves_the_competition_alone() -> None:
    """Queries whose scores all run high or low (an offset of the query), a match told by how far the best
    stands out and more likely for a low query: beside the competition the score's own weight comes out
    negative, so the scale is the competition's and the size's alone (slope 0): still a monotone map of
    the score for a query, not "no scale"."""
    rng = np.random.default_rng(0)
    offset = rng.normal(0.0, 2.0, (3000, 1))
    scores = offset + rng.normal(0.0, 1.0, (3000, 50))
    margin = rng.uniform(0.0, 3.0, 3000)
    scores[:, 0] = scores[:, 1:].max(axis=1) + margin
    matches = np.zeros(scores.shape, bool)
    matches[:, 0] = rng.random(3000) < 1.0 / (1.0 + np.exp(-(2.0 * margin - 1.5 * offset[:, 0])))
    pairs = shown(scores, matches, True)
    pad = float(scores.min())
    x = pairs.competition(beta=1.0, pad=pad)
    free, _ = _logistic(np.column_stack([pairs.score, x, np.ones_like(x)]), pairs.match.astype(np.float64))
    assert free[0] < 0 < free[1]  # the case: the score's own weight against the match
    rel = _fit(pairs, pad)
    assert rel.slope == 0.0 and rel.context > 0
    one = rel.for_query("search", scores[0])
    assert np.all(np.diff(one(np.sort(scores[0]))) > 0)


def test_competition_is_the_log_odds_of_being_the_one_among_the_best_others() -> None:
    """x = beta S - log sum exp(beta S_j) over the `top` best other items, a listed item left out of its own
    sum, a collection of fewer counted with `pad` scores; increasing in S."""
    best = np.array([[3.0, 2.0, 1.0, -np.inf]])
    beta, top, pad = 2.0, 3, 0.5
    got = competition(best, np.array([[3.0, 1.0, 0.7]]), beta, top, pad)[0]
    lse = np.logaddexp.reduce
    assert got[0] == pytest.approx(6.0 - lse([4.0, 2.0, 1.0]))  # 2 and 1, and one missing at the pad
    assert got[1] == pytest.approx(2.0 - lse([6.0, 4.0, 1.0]))
    assert got[2] == pytest.approx(1.4 - lse([6.0, 4.0, 2.0]))  # below the list: all three count
    s = np.linspace(-2.0, 5.0, 50)[None]
    assert np.all(np.diff(competition(np.array([[4.0, 3.5, 3.0, 1.0]]), s, 3.0, 3, 0.0)[0]) > 0)


def test_a_relevance_scale_round_trips_and_an_earlier_form_is_not_read() -> None:
    rel = Relevance(5.0, 0.8, 40.0, -0.3, 0.8, 0.07, -0.1, -0.5)
    assert Relevance.from_state(rel.to_state()) == rel
    assert Relevance.from_state({"slope": 2.0, "intercept": -2.0, "own_slope": 3.0, "own_intercept": 1.0}) is None
    assert Relevance.from_state({**rel.to_state(), "form": "context-1"}) is None  # no size terms: refit
    assert Relevance.from_state(None) is None
    with pytest.raises(ValueError, match="side"):
        rel.for_query("sideways", [1.0])


def test_a_larger_collection_moves_the_relevance_by_its_sides_size_term_alone() -> None:
    """The same best scores in a collection of more items: the log-odds move by the side's size term times
    the log of the ratio, the ranking stays; without a count the scores given are the collection."""
    rel = Relevance(5.0, 0.8, 40.0, -0.3, 0.8, 0.07, -0.2, -0.5)
    best = np.linspace(0.3, -0.2, 101)
    for side, size in (("search", rel.search_size), ("annotate", rel.annotate_size)):
        small, large = rel.for_query(side, best, 200), rel.for_query(side, best, 20_000)
        np.testing.assert_allclose(large.log_odds(best[:5]) - small.log_odds(best[:5]), size * np.log(100.0))
        assert np.all(np.diff(large(best[:10])) < 0)
    assert rel.for_query("search", best).items == 101
    assert rel.for_query("search", best, 0).items == 101  # never fewer than the scores it was given


def test_described_alike_marks_the_own_image_and_captions_as_close_as_its_own() -> None:
    """Sentences near their own image's others are matched to the own image; a caption repeated word for
    word under another image makes that image a match too; unrelated images are not."""
    rng = np.random.default_rng(2)
    n_img, per, dim = 20, 5, 32
    centres = rng.normal(size=(n_img, dim))
    vecs = np.repeat(centres, per, axis=0) + 0.3 * rng.normal(size=(n_img * per, dim))
    vecs[7 * per] = vecs[3 * per + 1]  # image 7's first caption says what image 3's second says
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    pair = np.repeat(np.arange(n_img), per)
    for seed in range(5):  # whichever caption of image 7 is left out, most draws keep the copy
        m = described_alike(vecs, pair, seed=seed)
        assert m[pair, np.arange(len(pair))].all()
        unrelated = m.copy()
        unrelated[pair, np.arange(len(pair))] = False
        unrelated[7, 3 * per + 1] = unrelated[3, 7 * per] = False
        assert not unrelated.any()
    assert sum(described_alike(vecs, pair, seed=seed)[7, 3 * per + 1] for seed in range(10)) >= 5
    search, annotate = alike_blocks(vecs, pair, n_img, len(pair))  # every image and caption a query's
    np.testing.assert_array_equal(search, described_alike(vecs, pair))
    np.testing.assert_array_equal(annotate, search)
    search, annotate = alike_blocks(vecs, pair, 10, 10 * per)  # the first ten images' queries
    assert search.shape == (n_img, 10 * per) and annotate.shape == (10, len(pair))
    copied = [alike_blocks(vecs, pair, 10, 10 * per, seed=seed) for seed in range(10)]  # seen from either side
    assert sum(a[3, 7 * per] for _, a in copied) >= 5 and sum(s[7, 3 * per + 1] for s, _ in copied) >= 5
    assert annotate[pair[: 10 * per], np.arange(10 * per)].all() and not annotate[:, pair >= 10].any()


def test_relevance_is_stored_with_the_calibration_and_older_checkpoints_load_without_it(
        shapes_model: ShapesModel, tmp_path: Path) -> None:
    cal = _random_calibration()
    cal.relevance = SCALE
    again = Calibration.from_arrays(cal.to_arrays(), cal.settings())
    assert again.relevance == SCALE
    older = cal.settings()
    del older["relevance"]  # a checkpoint from before the scale
    assert Calibration.from_arrays(cal.to_arrays(), older).relevance is None
    bundle = Bundle.load(shapes_model.model_path)
    assert bundle.relevance is None  # uncalibrated: no scale
    bundle.calibration = fit_calibration(bundle, shapes_model.dev, refs=10, seed=0)
    assert bundle.relevance is None
    bundle.calibration.relevance = SCALE
    bundle.save(tmp_path / "m")
    assert Bundle.load(tmp_path / "m").relevance == SCALE
    ckpt = Checkpoint.load(shapes_model.model_path)  # and in the trainer's checkpoint
    ckpt.calibration = bundle.calibration
    ckpt.save(tmp_path / "m.pt")
    relevance = SCALE
    assert Bundle.load(tmp_path / "m.pt").relevance == Checkpoint.load(tmp_path / "m.pt").relevance == relevance


def test_a_calibration_is_stored_without_its_padding_and_loads_as_before() -> None:
    """The reference sentences' padding is left out of a checkpoint; one saved with it still loads the same."""
    from fragsearch.model.calibration import Calibration

    rng = np.random.default_rng(0)
    mask = (rng.random((6, 5)) > 0.4).astype(np.float32)
    mask[:, 0] = 1.0
    sentences = rng.standard_normal((6, 5, 8)).astype(np.float32) * mask[..., None]
    cal = Calibration(rng.standard_normal((4, 3, 8)).astype(np.float32), sentences, mask)
    arrays = cal.to_arrays()
    assert "ref_sentences" not in arrays and arrays["ref_sentence_rows"].shape == (int(mask.sum()), 8)
    again = Calibration.from_arrays(arrays, cal.settings())
    old = Calibration.from_arrays({**{k: v for k, v in arrays.items() if k != "ref_sentence_rows"},
                                   "ref_sentences": sentences.astype(np.float16)}, cal.settings())
    for loaded in (again, old):
        assert np.array_equal(loaded.ref_sentences, sentences.astype(np.float16).astype(np.float32))
        assert np.array_equal(loaded.ref_sentence_mask, mask)


def _local_by_hand(cal: Calibration, img: torch.Tensor, blocks: int) -> torch.Tensor:
    """calibrate_images with a local scale, written out: every block over its spread, then all blocks over the
    local scale^p, the mean of the image's k best summed calibrated scores against the reference sentences."""
    h = img.shape[-1] // blocks
    parts = [slice(b * h, (b + 1) * h) for b in range(blocks)]
    im = torch.ones(img.shape[:2])
    raws = [skl(img[..., p], im, cal.ref_sentences[..., p], cal.ref_sentence_mask) for p in parts]
    spreads = [r.std(dim=1, unbiased=False).clamp_min(cal.floor_image) for r in raws]
    own = []
    for p in parts:  # each reference sentence's spread against the reference images, on the block's slice
        ref = cal.ref_images[..., p]
        own.append(skl(ref, torch.ones(ref.shape[:2]), cal.ref_sentences[..., p], cal.ref_sentence_mask)
                   .std(dim=0, unbiased=False).clamp_min(cal.floor_sentence))
    summed = sum(r / (s[:, None] * t[None, :]) for r, s, t in zip(raws, spreads, own, strict=True))
    assert isinstance(summed, torch.Tensor)
    local = summed.topk(cal.local_k, dim=1).values.mean(dim=1) ** cal.local_power
    return torch.cat([img[..., p] / (s * local)[:, None, None] for p, s in zip(parts, spreads, strict=True)], -1)


@pytest.mark.parametrize("blocks", [1, 2])
def test_a_local_scale_divides_every_block_by_the_items_best_reference_scores(blocks: int,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fragsearch.model.calibration.BLOCK", 4)  # the 9 images and 7 sentences below in several chunks
    cal = _random_calibration().localised(5, 0.75, blocks)
    assert cal.ref_sentence_scales is not None and cal.ref_sentence_scales.shape == (blocks, 40)
    g = torch.Generator().manual_seed(3)
    img, sent = torch.randn(9, 4, 6, generator=g), torch.randn(7, 3, 6, generator=g).relu()
    torch.testing.assert_close(cal.calibrate_images(img, blocks), _local_by_hand(cal, img, blocks))
    # the spread alone is what a calibration without it gives, and the local scale moves the ranking
    spread = _random_calibration()
    plain = spread.calibrate_images(img, blocks)
    assert not torch.allclose(cal.calibrate_images(img, blocks), plain)
    ratio = cal.calibrate_images(img, blocks) / plain  # one factor per image, the same in every block
    assert torch.allclose(ratio, ratio[:, :1, :1].expand_as(ratio), rtol=1e-4)
    sm = torch.ones(7, 3)
    assert cal.calibrate_sentences(sent, sm, blocks).shape == sent.shape
    # an image that never scores gets the floors, not a division by zero
    assert torch.isfinite(cal.calibrate_images(torch.zeros(2, 4, 6), blocks)).all()


def test_a_local_scale_is_stored_with_the_references_and_loads_as_it_was() -> None:
    cal = _random_calibration().localised(4, 0.5, 2)
    arrays, settings = cal.to_arrays(), cal.settings()
    assert settings["local_k"] == 4 and settings["local_power"] == 0.5
    assert arrays["ref_image_scales"].shape == (2, 30) and arrays["ref_sentence_scales"].shape == (2, 40)
    back = Calibration.from_arrays(arrays, settings)
    img = torch.randn(5, 4, 6, generator=torch.Generator().manual_seed(4))
    np.testing.assert_allclose(back.calibrate_images(img.numpy(), 2), cal.calibrate_images(img, 2).numpy(),
                               rtol=2e-2, atol=1e-5)  # the references are stored at half precision
    # a calibration without it stores what it stored before, and one saved before loads without it
    plain = _random_calibration()
    assert "local_k" not in plain.settings() and "ref_image_scales" not in plain.to_arrays()
    old = Calibration.from_arrays(plain.to_arrays(), plain.settings())
    assert old.local_power == 0.0 and old.ref_image_scales is None
    needs = Calibration(plain.ref_images, plain.ref_sentences, plain.ref_sentence_mask, local_k=3, local_power=0.5)
    with pytest.raises(ValueError, match="localised"):
        needs.calibrate_images(img, 1)


def test_a_local_scale_keeps_to_the_device_of_its_inputs() -> None:
    """The local scale on torch's `meta` device (no data: shapes and devices only), from the blocks' scores
    against the references: every array it makes stays on the inputs' device, as it would on a GPU."""
    cal = _random_calibration().localised(5, 0.75, 2)
    assert cal.ref_sentence_scales is not None
    meta = replace(cal, ref_sentence_scales=cal.ref_sentence_scales.to("meta"))
    scores = [torch.empty(3, 40, device="meta") for _ in range(2)]
    out = meta._calibrate(torch.empty(3, 4, 6, device="meta"), scores, meta.floor_image, meta.ref_sentence_scales)
    assert out.device.type == "meta" and out.shape == (3, 4, 6)


def test_the_calibrate_command_chooses_a_local_scale_on_the_validation_part(shapes_model: ShapesModel,
                                                                            tmp_path: Path) -> None:
    """`python -m fragsearch.training.calibrate --relevance-only --local-k … --local-power …` (the released model's
    recipe): the best validation R-sum among the spread alone and each (k, p), the relevance refitted, the
    validation metrics the checkpoint carries those of the choice."""
    from fragsearch.commands.calibrate import main as calibrate_main
    from fragsearch.model.data import load_split
    from fragsearch.model.dataset import held_out_split, hold_out, load_split_data
    from fragsearch.model.parsers import make_parser

    ckpt = Checkpoint.load(shapes_model.model_path)
    train = load_split_data(shapes_model.data, "train", ckpt.image_cfg, shapes_model.cache, make_parser("spacy"))
    rest, _ = hold_out(train, 20, 0)
    ckpt.calibration = fit_calibration(ckpt, rest, refs=20, seed=0)
    ckpt.meta["train"] = {**ckpt.meta.get("train", {}), "selection": "val", "val_images": 20, "val_seed": 0}
    ckpt.save(tmp_path / "model.pt")
    common = ["--data", str(shapes_model.data), "--cache", str(shapes_model.cache), "--device", "cpu"]
    calibrate_main(["--model", str(tmp_path / "model.pt"), "--relevance-only", "--local-k", "2,4",
                    "--local-power", "0.5,0.75", "--out", str(tmp_path / "local.pt"), *common])
    out = Checkpoint.load(tmp_path / "local.pt")
    assert out.calibration is not None and out.relevance is not None
    grid = out.meta["calibration"]["local"]["grid"]
    assert [(g["local_k"], g["local_power"]) for g in grid] == [(0, 0.0), (2, 0.5), (2, 0.75), (4, 0.5), (4, 0.75)]
    best = max(grid, key=lambda g: g["val_rsum"])  # the first of equals
    assert (out.calibration.local_k, out.calibration.local_power) == (best["local_k"], best["local_power"])
    assert round(out.meta["selection"]["val"]["rsum"], 2) == best["val_rsum"]
    val = load_split_data(shapes_model.data, held_out_split(load_split(shapes_model.data, "train"), 20, 0),
                          out.image_cfg, shapes_model.cache, make_parser("spacy"))
    assert round(evaluate(out, val)["rsum"], 2) == best["val_rsum"], "the saved model scores as chosen"
    with pytest.raises(SystemExit):  # chosen on the validation part only
        calibrate_main(["--model", str(tmp_path / "model.pt"), "--local-k", "2", *common])
    with pytest.raises(SystemExit):
        calibrate_main(["--model", str(tmp_path / "model.pt"), "--relevance-only", "--local-k", "0", *common])


def test_a_sentences_scale_read_through_the_references_codes_is_the_float_scale_within_a_thousandth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's references (NumPy, large) are read through their 8-bit codes (model/product.py); a scale from
    them is the float32 references' within a thousandth, block by block, and the same alone or in a batch (its
    products are; NumPy's sums may round otherwise in an array of another shape)."""
    from fragsearch.model import product

    rng = np.random.default_rng(7)
    ref_img = rng.standard_normal((300, 20, 64)).astype(np.float32)
    ref_sent = np.maximum(rng.standard_normal((40, 3, 64)), 0).astype(np.float32)
    cal = Calibration(ref_img, ref_sent, np.ones((40, 3), np.float32), floor_image=1e-3, floor_sentence=1e-3)
    sent = np.maximum(rng.standard_normal((50, 4, 64)), 0).astype(np.float32)
    mask = np.ones((50, 4), np.float32)
    mask[::4, 3] = 0
    part = slice(32, 64)
    assert cal.reference_codes(part) is not None and cal.reference_codes(part) is cal.reference_codes(part)
    coded = cal.sentence_scales(sent[..., part], mask, part)
    alone = np.concatenate([cal.sentence_scales(sent[i : i + 1, :, part], mask[i : i + 1], part) for i in range(3)])
    np.testing.assert_allclose(alone, coded[:3], rtol=1e-6)  # the same products; the sums' rounding aside
    monkeypatch.setattr(product, "QUANTIZED", False)
    plain = Calibration(ref_img, ref_sent, np.ones((40, 3), np.float32), floor_image=1e-3, floor_sentence=1e-3)
    assert plain.reference_codes(part) is None
    exact = plain.sentence_scales(sent[..., part], mask, part)
    assert np.abs(coded / exact - 1).max() < 1e-3
    assert _random_calibration().reference_codes() is None  # torch tensors (training) are read in float32
