"""bench.ensemble: the sum of members' scores, ranked; a member twice ranks as the member alone."""

from __future__ import annotations

import numpy as np
import pytest

from bench.ensemble import member_scores, rows_for
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import select_images
from fragsearch.model.encoders import Encoders
from fragsearch.training.evaluate import metrics_from_scores
from tests.conftest import OtherFeaturesModel, ShapesModel


def test_an_ensemble_ranks_by_the_sum_of_its_members_scores(shapes_model: ShapesModel) -> None:
    twin = Bundle.load(shapes_model.model_path)
    rows = rows_for("dev", shapes_model.dev, {"a": shapes_model.bundle, "b": twin}, "cmd")
    assert [r["members"] for r in rows] == ["a", "b", "a+b"]
    assert rows[0]["rsum"] == rows[1]["rsum"] == rows[2]["rsum"]  # twice one model: the same ranking
    assert rows[2]["h_total"] == 2 * int(shapes_model.bundle.cfg.h)
    alone, _ = member_scores(shapes_model.bundle, shapes_model.dev)
    assert alone.shape == (len(shapes_model.dev.names), len(shapes_model.dev.sentences))


def test_an_ensemble_of_different_models_is_not_either_member(shapes_model: ShapesModel) -> None:
    """A member with shuffled image-side weights changes the sum's ranking: the rows are computed, not copied."""
    other = Bundle.load(shapes_model.model_path)
    gen = np.random.default_rng(0)
    weights = {k: w[..., gen.permutation(w.shape[-1])] if w.ndim > 1 else w for k, w in other.encoders.arrays().items()}
    other.encoders = Encoders(other.cfg, weights)
    rows = rows_for("dev", shapes_model.dev, {"a": shapes_model.bundle, "b": other}, "cmd")
    a, b, both = (np.asarray([r[k] for k in ("annot_r1", "search_r1", "rsum")], float) for r in rows)
    assert not np.array_equal(a, b)
    assert not (np.array_equal(both, a) and np.array_equal(both, b))


def test_three_members_give_each_alone_then_the_first_two_then_all(shapes_model: ShapesModel) -> None:
    members = {name: Bundle.load(shapes_model.model_path) for name in ("a", "b", "c")}
    rows = rows_for("dev", shapes_model.dev, members, "cmd")
    assert [r["members"] for r in rows] == ["a", "b", "c", "a+b", "a+b+c"]
    assert [r["h_total"] for r in rows[3:]] == [2 * int(shapes_model.bundle.cfg.h),
                                                3 * int(shapes_model.bundle.cfg.h)]


def test_members_on_other_image_features_each_score_their_own(shapes_model: ShapesModel,
                                                              other_features_model: OtherFeaturesModel) -> None:
    """A member trained on other regions scores the same images from its own features: the sum's ranking is
    that of the two members' scores, each on its own data; data of other images is refused."""
    bundles = {"a": shapes_model.bundle, "b": other_features_model.bundle}
    own = {"a": shapes_model.dev, "b": other_features_model.dev}
    rows = rows_for("dev", own, bundles, "cmd")
    total = member_scores(shapes_model.bundle, shapes_model.dev)[0] + member_scores(
        other_features_model.bundle, other_features_model.dev)[0]
    m = metrics_from_scores(total, shapes_model.dev.pair_image)
    assert rows[2]["members"] == "a+b" and rows[2]["rsum"] == round(m["rsum"], 1)
    assert rows[1]["rsum"] == rows_for("dev", other_features_model.dev, {"b": other_features_model.bundle},
                                       "cmd")[0]["rsum"]
    with pytest.raises(ValueError, match="other images or sentences"):
        rows_for("dev", {"a": shapes_model.dev, "b": select_images(other_features_model.dev, np.arange(5))},
                 bundles, "cmd")
