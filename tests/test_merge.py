"""Merging fragment models into one: the merged fragments are the members' side by side."""

from __future__ import annotations

import pytest
import torch

from model.encoders import FragmentModel, ModelConfig
from model.score import skl
from training.merge import merge_models


def _member(seed: int, h: int) -> FragmentModel:
    torch.manual_seed(seed)
    model = FragmentModel(ModelConfig(h=h, n_relations=3, img_dim=12, word_dim=5, input_dropout=0.2)).eval()
    with torch.no_grad():
        model.image.bias.normal_()  # type: ignore[union-attr,operator]
        for b in model.b_rel:
            b.normal_()
    return model


def test_merged_fragments_are_the_members_side_by_side() -> None:
    members = [_member(0, 4), _member(1, 6), _member(2, 4)]
    merged = merge_models(members)
    assert merged.cfg.h == 14 and not merged.training
    feats = torch.randn(2, 3, 12)
    pool = torch.randn(9, 5)
    rel = torch.tensor([[0, 1, 2], [2, 0, 0]])
    a, b = torch.randint(0, 9, (2, 3)), torch.randint(0, 9, (2, 3))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    with torch.no_grad():
        img = merged.embed_images(feats)
        sent = merged.embed_sentences(pool, rel, a, b, mask)
        torch.testing.assert_close(img, torch.cat([m.embed_images(feats) for m in members], dim=2))
        torch.testing.assert_close(sent, torch.cat([m.embed_sentences(pool, rel, a, b, mask) for m in members], dim=2))
        # the one S_kl of the merged fragments thresholds the sum of the members' fragment scores
        s = skl(img, torch.ones(img.shape[:2]), sent, mask)
    assert s.shape == (2, 2) and torch.isfinite(s).all()


def test_members_of_other_shapes_are_refused() -> None:
    other = FragmentModel(ModelConfig(h=4, n_relations=2, img_dim=12, word_dim=5))
    with pytest.raises(ValueError, match="differ in shape"):
        merge_models([_member(0, 4), other])
    hidden = FragmentModel(ModelConfig(h=4, n_relations=3, img_dim=12, word_dim=5, image_hidden=8))
    with pytest.raises(ValueError, match="linear"):
        merge_models([hidden, _member(0, 4)])
