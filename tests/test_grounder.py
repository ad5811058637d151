"""The grounder (model/grounder.py, trained by training/grounder.py): where each thing a sentence names is.

Trained on the shapes training pictures with their known boxes given as Entities annotations (each caption's
"a red circle" names the circle's box), it must find the shape named in dev pictures it never saw, through
the service's own alignment; its runtime scores must be the trainer's; a model keeps it through save and load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fragsearch.index.matches import SentenceReading, aligned, read_sentence
from fragsearch.model.boxes import box_iou
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import hold_out
from fragsearch.model.embed import embed_texts
from fragsearch.model.entities import ImageEntities, parse_caption
from fragsearch.model.evidence import SCORES, thing_members
from fragsearch.model.grounder import (
    FUSION,
    GEOMETRY,
    Grounder,
    Refiner,
    SentenceGrounding,
    box_deltas,
    fused,
    fused_box,
    fusion_weights,
    geometry,
    moved_boxes,
    named_by,
)
from fragsearch.model.text import Triplet
from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from fragsearch.training.grounder import (
    IOU,
    Samples,
    accuracy_of,
    fit_grounder,
    fit_refiner,
    fused_accuracy,
    moved_of,
    samples_of,
    scores_of,
)
from tests.conftest import ShapesModel
from tests.conftest_service import engine_over_dev
from tests.synthetic import TEMPLATES, iou

pytest_plugins = ["tests.conftest_service"]


def shapes_entities(shapes: ShapesModel) -> dict[str, ImageEntities]:
    """The shapes pictures' captions annotated as Flickr30k Entities annotates Flickr30K's: each shape's phrase
    ("a red circle") with its chain, the chain's box the shape's."""
    out = {}
    for name, (a, b) in shapes.objects.items():
        lines = [t.replace("{c1} {s1}", "[/EN#1/other {c1} {s1}]").replace("{c2} {s2}", "[/EN#2/other {c2} {s2}]")
                 .format(c1=a["colour"], s1=a["shape"], c2=b["colour"], s2=b["shape"]) for t in TEMPLATES]
        ents = ImageEntities(Path(name).stem, 224, 224, [parse_caption(line) for line in lines])
        ents.boxes = {"1": np.asarray([a["box"]], np.float32), "2": np.asarray([b["box"]], np.float32)}
        out[name] = ents
    return out


@pytest.fixture(scope="module")
def grounded(shapes_model: ShapesModel, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, dict[str, float]]:
    """The shapes model with a grounder trained on 40 training pictures (epochs chosen on the other 20), saved;
    and the measures on the dev pictures."""
    from fragsearch.model.dataset import load_split_data
    from fragsearch.model.parsers import make_parser

    bundle = Bundle.load(shapes_model.model_path)
    ents = shapes_entities(shapes_model)
    train = load_split_data(shapes_model.data, "train", bundle.image_cfg, shapes_model.cache, make_parser("spacy"))
    rest, val = hold_out(train, 20, 0)
    rest_samples, val_samples = samples_of(bundle, rest, ents), samples_of(bundle, val, ents)
    fit, report = fit_grounder(rest_samples, val_samples, hidden=32, epochs=40, batch=16)
    fit, _ = fit_refiner(fit, rest_samples, val_samples, hidden=32, epochs=20, batch=16)
    bundle.grounder = fit
    dev = samples_of(bundle, shapes_model.dev, ents)
    folder = tmp_path_factory.mktemp("grounded") / "model"
    bundle.save(folder)
    measures = {"dev": accuracy_of(fit, dev), "whole": dev.whole_image(),
                "upper": float((dev.iou >= IOU).any(axis=1).mean()), "val": report["val_accuracy"]}
    return folder, measures


def test_geometry_reads_boxes_in_the_image_frame() -> None:
    g = geometry(np.asarray([[0, 0, 200, 100], [50, 25, 150, 75]], np.float32))
    assert g.shape == (2, len(GEOMETRY))
    np.testing.assert_allclose(g[1, :4], [0.25, 0.25, 0.75, 0.75])
    np.testing.assert_allclose(g[:, 4], [1.0, 0.25])
    assert list(g[:, 7]) == [1.0, 0.0]


def test_a_triplet_draws_the_thing_its_role_names() -> None:
    trips = [Triplet("det", "dog", "a"), Triplet("nsubj", "runs", "dog"), Triplet("prep_through", "runs", "grass"),
             Triplet("prep_in", "dog", "grass"), Triplet("advmod", "runs", "fast")]
    things, members = thing_members(trips)
    assert things == ["dog", "grass"]
    assert [named_by(t, things) for t in trips] == ["dog", "dog", "grass", "grass", None]


def toy_reading(rng: np.random.Generator, boxes: np.ndarray, state: dict[str, Any] | None = None,
                refiner: Refiner | None = None) -> tuple[Grounder, np.ndarray, np.ndarray, SentenceGrounding]:
    """A grounder of random weights (h = 8, 6 hidden), an image of random fragments with `boxes`, and a sentence
    of three random triplet vectors naming a dog and grass, read by the grounder."""
    h, hidden = 8, 6
    g = Grounder(rng.normal(size=(hidden, 3 * h + len(GEOMETRY) + len(SCORES))).astype(np.float32),
                 rng.normal(size=hidden).astype(np.float32), rng.normal(size=hidden).astype(np.float32), 0.3,
                 state or {}, refiner)
    img = rng.normal(size=(len(boxes), h)).astype(np.float32)
    sent = rng.normal(size=(3, h)).astype(np.float32)
    trips = [Triplet("det", "dog", "a"), Triplet("nsubj", "runs", "dog"), Triplet("prep_on", "runs", "grass")]
    return g, img, sent, g.for_sentence(sent, trips, blocks=1)


def test_the_runtime_scores_as_the_trainer_does() -> None:
    rng = np.random.default_rng(0)
    f = 5
    boxes = np.asarray([[0, 0, 100, 80], [0, 0, 50, 40], [50, 0, 100, 40], [0, 40, 50, 80], [10, 10, 90, 70]],
                       np.float32)
    g, img, sent, reading = toy_reading(rng, boxes)
    runtime = reading.scores(img, boxes)
    from fragsearch.model.evidence import score_features, thing_direction, unit
    from fragsearch.model.score import alignment_scores

    samples = Samples(np.zeros(2, np.int64), np.stack([thing_direction(sent[m]) for m in reading.members]),
                      np.stack([score_features(alignment_scores(img, sent[m], 1)) for m in reading.members]),
                      np.zeros((2, f)),
                      unit(img)[None], geometry(boxes)[None])
    np.testing.assert_allclose(runtime, scores_of(g, samples), rtol=1e-4, atol=1e-4)
    assert reading.of_triplets(reading.regions(img, boxes)) == [int(np.argmax(runtime[0]))] * 2 + [
        int(np.argmax(runtime[1]))]
    # the place drawn: the best region, and the box fused from the scores with the grounder's fusion (its default)
    assert g.fusion == FUSION
    places = reading.places_of(img[None], boxes[None])[0]
    for n, thing in enumerate(reading.things):
        assert places[thing][0] == int(np.argmax(runtime[n]))
        np.testing.assert_allclose(places[thing][1], fused_box(runtime[n], boxes, *FUSION), rtol=1e-6)


def test_the_runtime_moves_the_boxes_as_the_trainer_does() -> None:
    """With a box refiner, the box drawn is the fusion of the moved boxes: the runtime's (one product per thing,
    only the boxes fused) equals the trainer's (every fragment moved, `moved_of`)."""
    rng = np.random.default_rng(1)
    h, f = 8, 5
    refiner = Refiner(rng.normal(size=(7, 3 * h + len(GEOMETRY))).astype(np.float32),
                      rng.normal(size=7).astype(np.float32), 0.3 * rng.normal(size=(4, 7)).astype(np.float32),
                      rng.normal(size=4).astype(np.float32))
    boxes = np.asarray([[0, 0, 100, 80], [0, 0, 50, 40], [20, 0, 100, 40], [0, 30, 50, 80], [10, 10, 90, 70]],
                       np.float32)
    g, img, sent, reading = toy_reading(rng, boxes, {"fusion": {"temperature": 2.0, "overlap": 0.05}}, refiner)
    runtime = reading.scores(img, boxes)
    from fragsearch.model.evidence import thing_direction, unit

    samples = Samples(np.zeros(2, np.int64), np.stack([thing_direction(sent[m]) for m in reading.members]),
                      np.zeros((2, f, len(SCORES))), np.zeros((2, f)), unit(img)[None], geometry(boxes)[None],
                      boxes[None], [boxes[:1], boxes[:1]])
    moved = moved_of(g.refiner, samples)
    assert not np.allclose(moved, boxes[None])  # the refiner moves them
    assert (moved[..., 2:] <= boxes[0, 2:]).all() and (moved >= 0).all()  # within the image
    places = reading.places_of(img[None], boxes[None])[0]
    for n, thing in enumerate(reading.things):
        w = fusion_weights(runtime[n][None], boxes, 2.0, 0.05)
        assert (w > 0).sum() >= 2  # more than one box fused
        np.testing.assert_allclose(places[thing][1], fused(w, moved[n][None])[0], rtol=1e-4, atol=1e-3)
    # one thing's terms folded into one matrix: the deltas of the rows with its direction broadcast
    assert g.refiner is not None
    v, d = unit(img), samples.direction[0]
    np.testing.assert_allclose(g.refiner.deltas(v, g.refiner.fold(d), geometry(boxes)),
                               g.refiner.deltas(v, np.repeat(d[None], f, 0), geometry(boxes)), rtol=1e-4, atol=1e-4)
    # several images at once: each image's own
    two = reading.places_of(np.stack([img, img[::-1]]), np.stack([boxes, boxes]))
    assert two[0] == places
    assert two[1] == reading.places_of(img[::-1][None], boxes[None])[0]


def test_deltas_move_a_box_onto_its_target_within_the_image() -> None:
    boxes = np.asarray([[10, 20, 50, 40], [0, 0, 30, 90], [5, 5, 6, 6]], np.float32)
    targets = np.asarray([[20, 10, 80, 70], [2, 3, 29, 60], [0, 0, 40, 40]], np.float32)
    sizes = np.asarray([[100, 100]] * 3, np.float32)
    np.testing.assert_allclose(moved_boxes(boxes, box_deltas(boxes, targets), sizes), targets, atol=1e-3)
    assert np.all(box_deltas(boxes, boxes) == 0)
    far = moved_boxes(boxes[:1], np.asarray([[30.0, 0.0, 0.0, 0.0]]), sizes[:1])  # 12 widths right: clipped
    np.testing.assert_allclose(far, [[100, 20, 100, 40]])


def test_a_refiner_learns_where_each_thing_extends_from_its_direction() -> None:
    """Things of two kinds, each's box the fragment's moved its own way (kind A a quarter width right, kind B a
    third taller): trained on such samples, the refiner moves held-out ones onto their boxes, which it can only do
    reading the thing's direction."""
    rng = np.random.default_rng(0)
    h, n_frag = 6, 4

    def make(n_images: int) -> Samples:
        boxes, truth, kinds = [], [], []
        for _ in range(n_images):
            x0, y0 = rng.uniform(0, 40, size=(n_frag, 2)).T
            w, hh = rng.uniform(20, 50, size=(n_frag, 2)).T
            b = np.stack([x0, y0, x0 + w, y0 + hh], 1)
            b[0] = [0, 0, 200, 200]
            boxes.append(b)
            kind = int(rng.integers(2))
            p = b[1]
            dx, dy = (0.25 * (p[2] - p[0]), 0.0) if kind == 0 else (0.0, (p[3] - p[1]) / 3)
            truth.append(np.asarray([[p[0] + dx, p[1], p[2] + dx, p[3] + dy]], np.float32))
            kinds.append(kind)
        box_arr = np.asarray(boxes, np.float32)
        directions = np.eye(h, dtype=np.float32)[kinds]
        ious = np.stack([box_iou(box_arr[k], truth[k])[:, 0] for k in range(n_images)])
        images = rng.normal(size=(n_images, n_frag, h)).astype(np.float32)
        return Samples(np.arange(n_images), directions, np.zeros((n_images, n_frag, len(SCORES)), np.float32),
                       ious.astype(np.float32), images / np.linalg.norm(images, axis=-1, keepdims=True),
                       np.stack([geometry(b) for b in box_arr]), box_arr, truth)

    train, val, test = make(400), make(60), make(60)
    assert (train.iou[:, 1] >= 0.5).all() and (train.iou[:, 1] < 0.85).all()  # the fragment half holds the thing
    # a head that picks fragment 1 (its first score feature), which already holds every thing at IoU 0.5: the
    # epochs are told apart by the boxes' mean IoU
    first = np.zeros((1, 3 * h + len(GEOMETRY) + len(SCORES)), np.float32)
    first[0, 3 * h + len(GEOMETRY)] = 1.0
    for part in (train, val, test):
        part.scores[:, 1, 0] = 1.0
    g = Grounder(first, np.zeros(1, np.float32), np.ones(1, np.float32), 0.0,
                 {"fusion": {"temperature": 0.0, "overlap": 1.0}})
    assert (scores_of(g, val).argmax(axis=1) == 1).all()
    refined, report = fit_refiner(g, train, val, hidden=16, epochs=60, batch=32)
    assert refined.refiner is not None and report["val_unmoved"] == 1.0
    assert report["val_mean_iou"] > report["val_unmoved_mean_iou"]
    # a refiner that cannot beat the boxes unmoved is not kept: here, every box is already its thing's
    exact = make(40)
    for k in range(len(exact)):
        exact.truth[k] = exact.boxes[k, 1:2].copy()
    exact.iou[:, 1] = 1.0
    exact.scores[:, 1, 0] = 1.0
    same, none = fit_refiner(g, exact, exact, hidden=4, epochs=2, batch=32)
    assert same.refiner is None and none["kept"] is False
    moved = moved_of(refined.refiner, test)[:, 1]
    before = np.asarray([box_iou(test.boxes[k, 1], test.truth[k])[0, 0] for k in range(len(test))])
    after = np.asarray([box_iou(moved[k], test.truth[k])[0, 0] for k in range(len(test))])
    assert before.mean() < 0.75 and after.mean() > 0.85, (before.mean(), after.mean())  # measured: 0.68, 0.95
    kinds = test.direction.argmax(axis=1)
    assert min(after[kinds == 0].mean(), after[kinds == 1].mean()) > 0.8


def test_the_box_drawn_is_the_likely_regions_around_the_best_weighed_by_the_softmax() -> None:
    boxes = np.asarray([[0, 0, 100, 100], [10, 10, 50, 50], [20, 20, 60, 60], [70, 70, 90, 90]], np.float32)
    scores = np.asarray([0.0, 2.0, 2.0, 1.9])
    np.testing.assert_array_equal(fused_box(scores, boxes, 0.0, 0.2), boxes[1])  # temperature 0: the best's own
    # boxes 1 and 2 overlap at IoU 0.39, equally likely: their mean; box 3 (no overlap) and the whole image (IoU
    # 0.16 with the best) are left out however likely
    np.testing.assert_allclose(fused_box(scores, boxes, 0.5, 0.2), [15, 15, 55, 55])
    np.testing.assert_allclose(fused_box(scores, boxes, 0.5, 0.5), boxes[1])  # the overlap asked is more
    lower = fused_box(np.asarray([0.0, 2.0, 1.0, 1.9]), boxes, 0.5, 0.2)  # box 2 less likely: nearer box 1
    assert 10 < lower[0] < 15 and 50 < lower[2] < 55
    # a thing between two proposals: neither holds it at IoU 0.5, their fusion does
    pair = np.asarray([[0, 0, 100, 40], [0, 0, 40, 40], [30, 0, 70, 40]], np.float32)
    truth = [np.asarray([[15, 0, 55, 40]], np.float32)]
    samples = Samples(np.zeros(1, np.int64), np.zeros((1, 2), np.float32), np.zeros((1, 3, len(SCORES))),
                      np.zeros((1, 3)), np.zeros((1, 3, 2)), geometry(pair)[None], pair[None], truth)
    two = np.asarray([[-10.0, 1.0, 1.0]])  # the whole image (IoU 0.4 with either) all but ruled out
    assert fused_accuracy(two, samples, 0.0, 1.0) == 0.0
    assert fused_accuracy(two, samples, 0.6, 0.1) == 1.0
    assert fused_accuracy(two, samples, 0.6, 0.2) == 0.0  # the two overlap at IoU 0.14 only


def test_a_grounder_trained_on_boxes_finds_the_named_shape(grounded: tuple[Path, dict[str, float]]) -> None:
    _, m = grounded
    assert m["upper"] >= 0.6, m  # the regions must hold the shapes for the test to say anything (read first)
    assert m["whole"] < 0.2, m
    assert m["dev"] >= 0.75 * m["upper"], m


def test_a_model_keeps_its_grounder_through_save_and_load(grounded: tuple[Path, dict[str, float]]) -> None:
    folder, _ = grounded
    bundle = Bundle.load(folder)
    assert bundle.grounder is not None
    assert bundle.grounder.state["validation"]["val_accuracy"] > 0
    fusion = bundle.grounder.state["fusion"]  # chosen on the validation part, read back as the grounder's
    assert bundle.grounder.fusion == (fusion["temperature"], fusion["overlap"])
    assert fusion["val_accuracy"] >= fusion["val_unfused"]
    again = folder.parent / "again"
    bundle.save(again)
    reloaded = Bundle.load(again).grounder
    assert reloaded is not None
    np.testing.assert_array_equal(reloaded.w1, bundle.grounder.w1)
    assert bundle.grounder.refiner is not None and reloaded.refiner is not None  # the box refiner, kept
    np.testing.assert_array_equal(reloaded.refiner.w1, bundle.grounder.refiner.w1)
    np.testing.assert_array_equal(reloaded.refiner.b2, bundle.grounder.refiner.b2)
    refined = bundle.grounder.state["refiner"]
    assert refined["val_accuracy"] >= 0 and "history" not in bundle.grounder.summary()["refiner"]


def test_the_alignment_draws_each_shape_where_the_grounder_finds_it(
        grounded: tuple[Path, dict[str, float]], shapes_model: ShapesModel) -> None:
    """Through index/matches.py, as every answer draws it: the circle's triplets draw one region, and on most
    dev pictures it holds the circle; without the grounder they draw their own best regions."""
    bundle = Bundle.load(grounded[0])
    dev = shapes_model.dev
    vectors = bundle.embed_images(dev.feats)
    held = total = 0
    for k, name in enumerate(dev.names):
        a, b = shapes_model.objects[name]
        text = f"a {a['colour']} {a['shape']} beside a {b['colour']} {b['shape']} ."
        sent, trips = embed_texts(bundle, [text])[0]
        alignment, _ = aligned(vectors[k], sent, trips, dev.boxes[k], bundle.blocks, (),
                               read_sentence(bundle, sent, trips))
        things = thing_members(trips)[0]
        named = [m for m in alignment if named_by(Triplet(m.relation, *m.words), things) == a["shape"]]
        assert len({m.fragment for m in named}) <= 1, named
        if named:
            total += 1
            held += iou(named[0].box, list(np.asarray(a["box"], float))) >= IOU
        plain, _ = aligned(vectors[k], sent, trips, dev.boxes[k], bundle.blocks, (), SentenceReading())
        assert [m.triplet for m in plain] == [m.triplet for m in alignment if m.found is None]
    assert total >= len(dev.names) // 2
    assert held >= 0.6 * total, (held, total)


def test_explain_draws_the_grounders_region(grounded: tuple[Path, dict[str, float]], shapes_model: ShapesModel,
                                            tmp_path: Path) -> None:
    bundle = Bundle.load(grounded[0])
    engine: Engine = engine_over_dev(shapes_model, bundle, tmp_path)
    name = shapes_model.dev.names[0]
    a, b = shapes_model.objects[name]
    text = f"a {a['colour']} {a['shape']} beside a {b['colour']} {b['shape']} ."
    with TestClient(create_app(engine.settings, engine=engine)) as client:
        top = client.post("/search/images", json={"sentence": text, "k": 1}).json()["results"][0]
        body = client.post("/explain", json={"image_id": top["id"], "sentence": text}).json()
    stored = engine.images.fragments(int(top["id"]))
    assert stored is not None
    sent, trips = embed_texts(bundle, [text])[0]
    g = bundle.grounder
    assert g is not None
    regions = g.for_sentence(sent, trips, bundle.blocks).regions(*stored)
    drawn = 0
    for m in body["alignment"]:
        thing = named_by(Triplet(m["relation"], *m["words"]), list(regions))
        if thing is not None and m["fragment"] is not None:
            assert m["fragment"] == regions[thing], (m, regions)
            drawn += 1
    assert drawn, body["alignment"]
