"""bench.channels: S_kl over subsets of a model's fragments."""

from __future__ import annotations

import torch

from bench.channels import channel_rsums
from model.evaluate import evaluate
from tests.conftest import ShapesModel


def test_channels_all_is_the_models_score_and_regions_carry_the_shapes(shapes_model: ShapesModel) -> None:
    bundle, dev = shapes_model.bundle, shapes_model.dev
    enc = bundle.text.encode_parsed(dev.parsed, dev.sentences)
    with torch.no_grad():
        sent, mask = bundle.embed_sentences(enc)
    rels = [[t.rel for t in trip] for trip in enc.triplets]
    r = channel_rsums(bundle, dev.feats, rels, sent, mask, dev.pair_image)
    assert abs(r["all"] - round(evaluate(bundle, dev)["rsum"], 1)) < 1e-6
    assert "whole-pair" not in r  # the paper's configuration has no whole-sentence fragment
    assert r["triplets"] == r["all"]  # ... so its triplets are all its sentence fragments
    chance = 100 * (1 + 5 + 10) / len(dev.names) * 2  # R@1+R@5+R@10, both directions, at random
    assert r["regions"] > 2 * chance  # each caption's shapes are found among the regions
