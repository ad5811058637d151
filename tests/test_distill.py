"""Distillation: a trained model's batch S_kl as soft targets (training/distill.py, distill_loss)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from model.bundle import Bundle
from model.dataset import load_split_data
from model.parsers import make_parser
from model.words import WordTable
from tests.conftest import ShapesModel
from training.distill import Teacher
from training.evaluate import score_split
from training.objectives import distill_loss
from training.train import make_run, train

SMALL = {"epochs": 6, "dense_epochs": 2, "anneal_epochs": 1, "batch_size": 20, "h": 32, "lr": 3e-3, "seed": 3}


def standard(s: torch.Tensor) -> torch.Tensor:
    return (s - s.mean()) / s.std()


def test_the_loss_is_nought_for_the_teachers_own_ranking_and_pulls_a_student_towards_it() -> None:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(8, 12, generator=gen)
    same = (3.0 * teacher + 2.0).requires_grad_()  # another scale and offset, the same ranking
    assert float(distill_loss(same, teacher, 3.0)) == pytest.approx(0.0, abs=1e-5)
    student = torch.randn(8, 12, generator=gen).requires_grad_()
    before = float(distill_loss(student, teacher, 3.0))
    assert before > 0.1
    agree = float((standard(student) * standard(teacher)).mean())
    opt = torch.optim.SGD([student], lr=0.5)
    for _ in range(50):
        opt.zero_grad()
        distill_loss(student, teacher, 3.0).backward()
        opt.step()
    assert float(distill_loss(student, teacher, 3.0)) < before / 4
    assert float((standard(student.detach()) * standard(teacher)).mean()) > agree + 0.3, "the ranking moved"


def test_a_teacher_reading_other_words_or_images_is_refused(shapes_model: ShapesModel) -> None:
    bundle = Bundle.load(shapes_model.model_path)
    feats = torch.from_numpy(shapes_model.dev.feats)
    text = bundle.text
    other = dataclasses.replace(bundle.image_cfg, n_regions=bundle.image_cfg.n_regions - 1)
    with pytest.raises(ValueError, match="other image features"):
        Teacher(shapes_model.model_path, text, other, feats, "cpu")
    text.words = WordTable(text.words.words[::-1], text.words.vectors[::-1])
    with pytest.raises(ValueError, match="other words or relations"):
        Teacher(shapes_model.model_path, text, bundle.image_cfg, feats, "cpu")


def test_a_student_trained_with_a_teacher_ranks_as_the_teacher_more_than_alone(shapes_model: ShapesModel,
                                                                                tmp_path: Path) -> None:
    """The same small run twice, from one seed, with and without the shapes model as its teacher: on dev,
    the distilled student's S_kl agree more with the teacher's than the student's alone do."""
    teacher = Bundle.load(shapes_model.model_path)
    tr = load_split_data(shapes_model.data, "train", teacher.image_cfg, shapes_model.cache, make_parser("spacy"))

    def dev_scores(bundle: Bundle) -> np.ndarray:
        enc = bundle.text.encode_parsed(shapes_model.dev.parsed, shapes_model.dev.sentences)
        return score_split(bundle, shapes_model.dev.feats, enc)

    runs = {"alone": {}, "distilled": {"distill_from": str(shapes_model.model_path)}}  # the default weight and scale
    agreement = {}
    want = dev_scores(teacher).ravel()
    for name, extra in runs.items():
        summary = train(make_run("paper", {**SMALL, **extra}), tr, None, tmp_path / name, shapes_model.cache)
        assert np.isfinite(summary["history"][-1]["loss"])
        got = dev_scores(Bundle.load(tmp_path / name / "model.pt")).ravel()
        agreement[name] = float(np.corrcoef(got, want)[0, 1])
    recorded = Bundle.load(tmp_path / "distilled" / "model.pt").meta["train"]["distill_from"]
    assert recorded == str(shapes_model.model_path)
    assert agreement["distilled"] > agreement["alone"] + 0.03, agreement  # measured: 0.851 against 0.753
