"""The presence head (model/evidence.py `PresenceHead`, training/presence.py): whether the thing a phrase names is
in a picture, whatever else of the sentence fits it; stored with the model and read by phrase evidence."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fragsearch.model.bundle import Bundle
from fragsearch.model.evidence import FEATURES, SCORES, PhraseEvidence, PresenceHead, features_of, pool
from fragsearch.training.presence import OWN, SWAPPED, Samples, fit_presence, measures_of, presence_of, samples_of
from tests.conftest import ShapesModel

pytest_plugins = ["tests.conftest_service"]


def random_head(h: int = 8, rank: int = 4, hidden: int = 6, seed: int = 0) -> PresenceHead:
    rng = np.random.default_rng(seed)
    return PresenceHead(rng.normal(size=(rank, h)).astype(np.float32), rng.normal(size=(rank, h)).astype(np.float32),
                        rng.normal(size=(hidden, 3 * rank + len(SCORES))).astype(np.float32),
                        rng.normal(size=hidden).astype(np.float32), rng.normal(size=hidden).astype(np.float32), 0.3)


def test_pool_is_a_smooth_largest() -> None:
    s = np.array([[0.0, 0.0], [10.0, -10.0]])
    assert pool(s)[0] == pytest.approx(np.log(2))
    assert pool(s)[1] == pytest.approx(10.0, abs=1e-6)
    assert (pool(s) >= s.max(axis=1)).all()


def test_the_head_scores_each_fragment_as_its_formula_says() -> None:
    head = random_head()
    rng = np.random.default_rng(1)
    d, v, sc = rng.normal(size=(2, 8)), rng.normal(size=(5, 8)), rng.normal(size=(2, 5, len(SCORES)))
    got = head.fragment_scores(d, v, sc)
    for n in range(2):
        for f in range(5):
            a, c = head.p @ d[n], head.q @ v[f]
            x = np.maximum(head.w1 @ np.concatenate([a * c, a, c, sc[n, f]]) + head.b1, 0.0)
            assert got[n, f] == pytest.approx(float(x @ head.w2 + head.b2), rel=1e-4, abs=1e-4)
    assert head.presence(d, v, sc) == pytest.approx(pool(got), rel=1e-6)


def test_a_head_of_other_shapes_is_refused() -> None:
    head = random_head()
    arrays = {**head.to_arrays(), "w1": head.w1[:, :-1]}
    with pytest.raises(ValueError, match="presence head"):
        PresenceHead.from_parts(head.to_state(), arrays)
    assert PresenceHead.from_parts({"form": "presence-0"}, head.to_arrays()) is None
    again = PresenceHead.from_parts(head.to_state(), head.to_arrays())
    assert again is not None and np.array_equal(again.w1, head.w1) and again.b2 == pytest.approx(head.b2)


def test_evidence_fitted_with_a_head_needs_the_head() -> None:
    head = random_head()
    state = PhraseEvidence((0.1,) * len(features_of(head)), 0.0, head=head).to_state()
    assert tuple(state["features"]) == (*FEATURES, "presence")
    refs = np.zeros((3, 2, 8), np.float32)
    assert PhraseEvidence.from_state(state, refs, 1, None) is None  # a model without the head: refit
    scale = PhraseEvidence.from_state(state, refs, 1, head)
    assert scale is not None and scale.head is head
    earlier = PhraseEvidence((0.1,) * len(FEATURES), 0.0).to_state()
    kept = PhraseEvidence.from_state(earlier, refs, 1, head)
    assert kept is not None and kept.head is None  # weights fitted without a head read without it


@pytest.fixture(scope="module")
def shapes_samples(evidence_bundle: Bundle, shapes_model: ShapesModel) -> tuple[Samples, Samples]:
    from fragsearch.model.dataset import hold_out, load_split_data
    from fragsearch.model.parsers import make_parser

    train = load_split_data(shapes_model.data, "train", evidence_bundle.image_cfg, shapes_model.cache,
                            make_parser("spacy"))
    rest, val = hold_out(train, 20, 0)
    return samples_of(evidence_bundle, rest, {}, per_image=3), samples_of(evidence_bundle, val, {}, per_image=5)


def test_samples_hold_own_pictures_look_alikes_and_swapped_things(shapes_samples: tuple[Samples, Samples]) -> None:
    train, _ = shapes_samples
    assert (train.label[train.kind == OWN] == 1).all()  # a caption's thing is in its own picture
    swapped = train.kind == SWAPPED
    assert swapped.any()
    # a swapped caption read in its own picture: the noun was drawn among those the picture does not hold
    assert 0 < train.label[~swapped & (train.kind != OWN)].mean() < 1
    assert train.scores.shape == (len(train), train.images.shape[1], len(SCORES))


def test_a_trained_head_tells_a_swapped_shape_from_the_one_there(shapes_samples: tuple[Samples, Samples],
                                                                 evidence_model: Path, tmp_path: Path) -> None:
    train, val = shapes_samples
    head, report = fit_presence(train, val, rank=16, hidden=16, epochs=6, batch=64)
    score = presence_of(head, val)
    m = measures_of(score, val)
    assert report["val_auc"] == pytest.approx(m["auc"], abs=1e-3)  # the runtime's arithmetic is the trainer's
    # what it was trained for, far from chance on pictures it never saw (typically above 0.9)
    assert m["own_vs_swapped"] > 0.7, report
    # stored with the model and read back by phrase evidence
    bundle = Bundle.load(evidence_model)
    bundle.presence = head
    scale = bundle.evidence_scale((0.0,) * len(features_of(head)), 0.0, head)
    bundle.set_evidence(dataclasses.replace(scale))
    bundle.save(tmp_path / "m")
    again = Bundle.load(tmp_path / "m")
    assert again.presence is not None and np.array_equal(again.presence.q, head.q)
    assert again.evidence is not None and again.evidence.features == (*FEATURES, "presence")
