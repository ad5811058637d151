"""bench.channels: S_kl over subsets of a model's fragments."""

from __future__ import annotations

from bench.channels import channel_rsums
from fragsearch.training.evaluate import evaluate
from tests.conftest import ShapesModel


def test_channels_all_is_the_models_score_and_regions_carry_the_shapes(shapes_model: ShapesModel) -> None:
    bundle, dev = shapes_model.bundle, shapes_model.dev
    enc = bundle.text.encode_parsed(dev.parsed, dev.sentences)
    sent, mask = bundle.embed_sentences(enc)
    rels = [[t.rel for t in trip] for trip in enc.triplets]
    r = channel_rsums(bundle, dev.feats, rels, sent, mask, dev.pair_image)
    assert abs(r["all"] - round(evaluate(bundle, dev)["rsum"], 1)) < 1e-6
    assert "whole-pair" not in r  # the paper's configuration has no whole-sentence fragment
    assert r["triplets"] == r["all"]  # ... so its triplets are all its sentence fragments
    chance = 100 * (1 + 5 + 10) / len(dev.names) * 2  # R@1+R@5+R@10, both directions, at random
    assert r["regions"] > 2 * chance  # each caption's shapes are found among the regions


def test_merge_keeps_only_the_rows_not_evaluated_again(tmp_path) -> None:
    from bench import kept_rows

    path = tmp_path / "t.csv"
    path.write_text("model,rsum,command\nfull,285.5,a\ntwo-branch,296.7,b\n")
    assert kept_rows(path, merge=False, evaluated=["full"]) == []
    assert kept_rows(path, merge=True, evaluated=["full"]) == [{"model": "two-branch", "rsum": "296.7", "command": "b"}]
    assert kept_rows(tmp_path / "missing.csv", merge=True, evaluated=[]) == []
