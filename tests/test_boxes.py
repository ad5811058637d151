"""Box supervision (training/boxes.py, TrainConfig.box_supervision): which triplet is told which regions hold
its phrase, how a batch carries the labels, how they replace the MIL labels, and a training run that reads
them from Entities files beside its data folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fragsearch.model.entities import Caption, ImageEntities, Phrase
from fragsearch.model.score import flatten
from fragsearch.model.text import Triplet
from fragsearch.training.boxes import batch_labels, triplet_labels
from fragsearch.training.objectives import fragment_loss
from tests.conftest import exported
from tests.test_entities import shapes_entities

FRAGMENTS = np.asarray([[0, 0, 224, 224],  # the whole image
                        [10, 100, 110, 200],  # the dog
                        [0, 150, 224, 224],  # the grass
                        [150, 0, 224, 60]], np.float32)  # neither


def dog_on_grass() -> ImageEntities:
    caption = Caption(("a", "dog", "runs", "on", "the", "grass", "."),
                      (Phrase("1", ("animals",), ("a", "dog"), 0), Phrase("2", ("scene",), ("the", "grass"), 4)))
    # boxes in the original's 0-based pixels (448 x 448: twice the copy's)
    return ImageEntities("1", 448, 448, [caption],
                         {"1": np.asarray([[24, 204, 224, 404]], np.float32),
                          "2": np.asarray([[0, 300, 448, 448]], np.float32)})


def test_a_triplet_is_told_which_regions_hold_the_phrase_its_head_noun_names() -> None:
    trips = [Triplet("det", "dog", "a"), Triplet("nsubj", "runs", "dog"), Triplet("prep_on", "runs", "grass"),
             Triplet("prep_on", "dog", "grass"), Triplet("advmod", "runs", "fast"),
             Triplet("<sentence>", "a dog runs", "a dog runs")]
    labels = triplet_labels(trips, "A dog runs on the grass.", dog_on_grass(), FRAGMENTS)
    assert labels is not None and labels.shape == (6, 4) and labels.dtype == np.int8
    assert labels[0].tolist() == [-1, 1, -1, -1]  # det(dog, a): "a dog"
    assert labels[1].tolist() == [-1, 1, -1, -1]  # nsubj(runs, dog)
    assert labels[2].tolist() == [-1, -1, 1, -1]  # prep_on(runs, grass): "the grass"
    assert labels[3].tolist() == [-1, 1, 1, -1]  # both phrases: either region
    assert not labels[4].any() and not labels[5].any()  # no boxed phrase; the whole sentence: MIL's
    assert triplet_labels(trips, "Two cats sleep on a sofa .", dog_on_grass(), FRAGMENTS) is None  # no line
    assert triplet_labels(trips, "A dog runs on the grass.", None, FRAGMENTS) is None


def test_a_batch_carries_each_sentences_labels_at_its_own_images_rows() -> None:
    lab = np.asarray([[-1, 1, -1, -1], [0, 0, 0, 0]], np.int8)  # sentence 7: two triplets
    dense = batch_labels([None] * 7 + [lab], np.asarray([3, 7]), np.asarray([0, 1]), n_images=2, n_fragments=4,
                         n_rows=3)
    assert dense is not None and dense.shape == (8, 6)
    assert dense[4:8, 3].tolist() == [-1, 1, -1, -1]  # image 1's rows, sentence 1's first column
    assert int(np.abs(dense).sum()) == 4
    assert batch_labels([None] * 8, np.asarray([3, 7]), np.asarray([0, 1]), 2, 4, 3) is None
    assert batch_labels([None] * 7 + [lab], np.asarray([3, 7]), np.asarray([0, 1]), 2, 4, 3,
                        skip=np.asarray([False, True])) is None


def test_box_labels_replace_the_mil_labels_where_given() -> None:
    torch.manual_seed(0)
    img, sent = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    flat = flatten(img, torch.ones(1, 4), sent, torch.ones(1, 2))
    pos = torch.ones(1, 1, dtype=torch.bool)
    boxes = torch.zeros(4, 2, dtype=torch.int8)
    assert torch.equal(fragment_loss(flat, pos, mil=True, boxes=boxes), fragment_loss(flat, pos, mil=True))
    boxes[:, 0] = torch.tensor([-1, 1, -1, -1], dtype=torch.int8)
    y = torch.where(flat.scores.detach() > 0, 1.0, -1.0)  # MIL inside the pair (each column has a positive
    if not bool((y[:, 1] > 0).any()):  # or its best row)
        y[int(flat.scores[:, 1].argmax()), 1] = 1.0
    y[:, 0] = torch.tensor([-1.0, 1.0, -1.0, -1.0])
    hinge = torch.relu(1 - y * flat.scores)
    want = (hinge * (y > 0)).sum() / (y > 0).sum() + (hinge * (y < 0)).sum() / (y < 0).sum()
    assert torch.allclose(fragment_loss(flat, pos, mil=True, boxes=boxes), want)


def test_training_with_box_supervision_reads_the_entities_beside_the_data(tmp_path: Path) -> None:
    from fragsearch.model.dataset import load_split_data
    from fragsearch.model.fragments import TextPipeline
    from fragsearch.model.parsers import make_parser
    from fragsearch.training.train import box_labels, make_run, train
    from tests.synthetic import make_dataset

    make_dataset(tmp_path / "data", n_train=20, n_dev=4)
    shapes_entities(tmp_path / "data", tmp_path / "flickr30k-entities")
    run = make_run("paper", {"epochs": 2, "dense_epochs": 1, "anneal_epochs": 0, "batch_size": 10, "h": 16,
                             "box_supervision": True, "selection": "last"})
    cache = exported(tmp_path / "cache", run.image)
    data = load_split_data(tmp_path / "data", "train", run.image, cache, make_parser("spacy"))
    text = TextPipeline.fit(run.text, data.parsed, tmp_path / "cache" / "words")
    labels = box_labels(data, text.encode_parsed(data.parsed, data.sentences).triplets)
    assert len(labels) == len(data.sentences) and sum(x is not None for x in labels) >= len(labels) // 2
    summary = train(run, data, None, tmp_path / "model", tmp_path / "cache")
    assert (tmp_path / "model" / "model.pt").is_file() and summary["history"]
