"""bench.ensemble: the sum of members' scores, ranked; a member twice ranks as the member alone."""

from __future__ import annotations

import numpy as np

from bench.ensemble import member_scores, rows_for
from model.bundle import Bundle
from tests.conftest import ShapesModel


def test_an_ensemble_ranks_by_the_sum_of_its_members_scores(shapes_model: ShapesModel) -> None:
    twin = Bundle.load(shapes_model.model_path)
    rows = rows_for("dev", shapes_model.dev, {"a": shapes_model.bundle, "b": twin}, "cmd")
    assert [r["members"] for r in rows] == ["a", "b", "a+b"]
    assert rows[0]["rsum"] == rows[1]["rsum"] == rows[2]["rsum"]  # twice one model: the same ranking
    assert rows[2]["h_total"] == 2 * int(shapes_model.bundle.model.cfg.h)
    alone, _ = member_scores(shapes_model.bundle, shapes_model.dev)
    assert alone.shape == (len(shapes_model.dev.names), len(shapes_model.dev.sentences))


def test_an_ensemble_of_different_models_is_not_either_member(shapes_model: ShapesModel) -> None:
    """A member with shuffled image-side weights changes the sum's ranking: the rows are computed, not copied."""
    other = Bundle.load(shapes_model.model_path)
    gen = np.random.default_rng(0)
    for p in other.model.parameters():
        p.data = p.data[..., gen.permutation(p.shape[-1])] if p.dim() > 1 else p.data
    rows = rows_for("dev", shapes_model.dev, {"a": shapes_model.bundle, "b": other}, "cmd")
    a, b, both = (np.asarray([r[k] for k in ("annot_r1", "search_r1", "rsum")], float) for r in rows)
    assert not np.array_equal(a, b)
    assert not (np.array_equal(both, a) and np.array_equal(both, b))


def test_three_members_give_each_alone_then_the_first_two_then_all(shapes_model: ShapesModel) -> None:
    members = {name: Bundle.load(shapes_model.model_path) for name in ("a", "b", "c")}
    rows = rows_for("dev", shapes_model.dev, members, "cmd")
    assert [r["members"] for r in rows] == ["a", "b", "c", "a+b", "a+b+c"]
    assert [r["h_total"] for r in rows[3:]] == [2 * int(shapes_model.bundle.model.cfg.h),
                                                3 * int(shapes_model.bundle.model.cfg.h)]
