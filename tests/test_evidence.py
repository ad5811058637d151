"""Phrase evidence (model/evidence.py): which things a sentence names, `found` read against reference images,
the weights fitted on the shapes model's training images (training/evidence.py), and the answers that carry it:
a shape no picture of a collection holds is reported not found, with the reason; one it holds is found."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Relevance
from fragsearch.model.evidence import (
    FEATURES,
    FOUND,
    REFERENCES,
    PhraseEvidence,
    Standing,
    evidence_terms,
    known,
    named_things,
    thing_features,
    things_of,
)
from fragsearch.model.text import Triplet
from fragsearch.service.engine import Engine
from fragsearch.training.evidence import (
    balance,
    evidence_rows,
    fit_evidence,
    forms,
    named_alike,
    names_in,
    things_named,
    word_counts,
)
from fragsearch.training.relevance import Judged
from tests.conftest import ShapesModel

pytest_plugins = ["tests.conftest_service"]


def t(rel: str, w1: str, w2: str) -> Triplet:
    return Triplet(rel, w1, w2)


def test_named_things_are_the_nouns_of_a_sentence() -> None:
    triplets = [t("det", "dog", "a"), t("nsubj", "runs", "dog"), t("prep_through", "runs", "grass"),
                t("det", "grass", "the"), t("aux", "running", "is"), t("<sentence>", "s", "s")]
    assert named_things(triplets) == ["dog", "grass"]
    assert things_of(triplets[1], ["dog", "grass"]) == ["dog"]
    assert things_of(triplets[4], ["dog", "grass"]) == []
    assert things_of(triplets[5], ["dog", "grass"]) == []  # the whole-sentence fragment names no one thing


def test_places_in_the_picture_are_not_things() -> None:
    triplets = [t("prep_in", "stands", "front"), t("prep_of", "front", "house"), t("det", "house", "a")]
    assert named_things(triplets) == ["house"]


def test_a_lone_word_names_itself() -> None:
    assert named_things([t("<word>", "giraffe", "giraffe")]) == ["giraffe"]
    assert named_things([t("<word>", "42", "42")]) == []


def test_plural_and_singular_name_the_same_thing() -> None:
    assert names_in({"dogs", "grass"}, "dog")
    assert names_in({"men"}, "man") and names_in({"puppies"}, "puppy")
    assert not names_in({"cat"}, "dog")
    assert "women" in forms("woman")


def references(rng: np.random.Generator, n: int = 64, f: int = 4, h: int = 8) -> np.ndarray:
    return rng.normal(size=(n, f, h)).astype(np.float32)


def test_found_rises_with_how_far_an_image_stands_out_of_the_references() -> None:
    rng = np.random.default_rng(0)
    scale = PhraseEvidence((1.0, 0.0, 0.0, 0.0), -1.0, references(rng))
    dog = rng.normal(size=8).astype(np.float32)
    sent = np.stack([dog, rng.normal(size=8).astype(np.float32)])
    ev = scale.for_sentence(sent, [t("det", "dog", "a"), t("aux", "runs", "is")])
    assert ev.things == ["dog"] and ev.members == [[0]]
    holds = rng.normal(size=(4, 8)).astype(np.float32)
    holds[2] = 3 * dog  # a region that is the dog
    lacks = -np.abs(rng.normal(size=(4, 8))).astype(np.float32) * np.sign(dog)  # every region away from it
    got, missed = ev.found(holds), ev.found(lacks)
    assert got.things["dog"] > 0.9 and missed.things["dog"] < 0.1
    assert got.fragments == [got.things["dog"], None]  # the auxiliary names nothing
    assert missed.missing == ["dog"] and got.missing == []


def test_a_word_the_model_never_saw_is_not_found_where_one_it_knows_is() -> None:
    rng = np.random.default_rng(0)
    counts = {"dog": 40, "dogs": 12, "grass": 30}
    assert known("dog", counts) == pytest.approx(np.log1p(40))  # the commoner spelling
    assert known("giraffe", counts) == 0.0
    # found reads how well the model knows the word beside the standings (here weighed at nothing)
    scale = PhraseEvidence((0.0, 0.0, 0.0, 0.0, 1.0), -2.0, references(rng), counts=counts)
    assert scale.features == (*FEATURES, "known")
    thing = rng.normal(size=8).astype(np.float32)
    image = rng.normal(size=(4, 8)).astype(np.float32)
    image[1] = 3 * thing
    dog = scale.for_sentence(thing[None], [t("det", "dog", "a")])
    giraffe = scale.for_sentence(thing[None], [t("det", "giraffe", "a")])
    assert dog.features(image)[0, -1] == pytest.approx(np.log1p(40))
    assert giraffe.features(image)[0, -1] == 0.0
    assert dog.found(image).things["dog"] >= FOUND > giraffe.found(image).things["giraffe"]
    # the counts are stored with the weights, and a state with them reads back the same
    again = PhraseEvidence.from_state(scale.to_state(), references(rng), 1)
    assert again is not None and again.counts == counts and again.features == scale.features
    assert PhraseEvidence.from_state({**scale.to_state(), "counts": {}}, references(rng), 1) is None


def test_features_of_a_thing_read_every_triplet_that_holds_it() -> None:
    st = Standing(np.array([[1.0, 3.0, -2.0]]), np.array([[0.5, 1.0, -1.0]]))
    out = thing_features(st, [[0, 1], [2]])
    assert out.shape == (1, 2, 4)
    np.testing.assert_allclose(out[0, 0], [3.0, 2.0, 1.0, 0.75])
    np.testing.assert_allclose(out[0, 1], [-2.0, -2.0, -1.0, -1.0])


def test_evidence_terms_read_the_weakest_thing() -> None:
    terms = evidence_terms([0.9, 0.1])
    assert terms[0] == pytest.approx(np.log(0.1 / 0.9))
    assert terms[1] == pytest.approx(0.0, abs=1e-9)
    assert evidence_terms([]).tolist() == [0.0, 0.0]


def test_a_relevance_with_evidence_falls_when_a_thing_is_missing() -> None:
    rel = Relevance(10.0, 0.0, 1.0, -1.0, -1.0, 0.0, evidence=(1.0, 0.5)).for_query("search", [0.3, 0.2, 0.1])
    with_all = rel.of(0.3, evidence_terms([0.9, 0.9]))
    one_missing = rel.of(0.3, evidence_terms([0.9, 0.05]))
    assert with_all > 0.9 > 0.5 > one_missing
    state = rel.to_state()
    assert state["form"] == "evidence-1" and Relevance.from_state(state) is not None
    older = {**state, "form": "context-2"}
    del older["evidence"]
    back = Relevance.from_state(older)
    assert back is not None and not back.uses_evidence  # a scale without the terms reads as before


def test_a_picture_is_named_alike_when_it_holds_every_thing_the_caption_names() -> None:
    words = [{"a", "dog", "runs", "on", "grass"}, {"two", "dogs", "play"}, {"a", "cat"}]
    things = [["dog", "grass"], ["dog"], [], ["cat"]]
    got = things_named(words, things, np.arange(3), np.arange(4))
    assert got.tolist() == [[True, True, False, False],   # the dog on grass holds both, not the cat
                            [False, True, False, False],  # "dogs" names the dog; no grass
                            [False, False, False, True]]  # a caption that names nothing matches nothing
    # the blocks of a judged part: every image x the first captions, the part's images x every caption
    judged = Judged(np.zeros((3, 2)), np.zeros((3, 2), bool), np.zeros((2, 4)), np.zeros((2, 4), bool),
                    np.array([0, 1, 2, 2]), 2)
    named = named_alike(judged, words, things)
    assert named.search_matches.tolist() == got[:, :2].tolist()
    assert named.annotate_matches.tolist() == got[:2].tolist()
    # what was a match stays one
    kept = named_alike(Judged(judged.search, np.ones((3, 2), bool), judged.annotate, np.ones((2, 4), bool),
                              judged.caption_image, 2), words, things)
    assert kept.search_matches.all() and kept.annotate_matches.all()


def test_balance_weighs_present_and_absent_alike() -> None:
    from fragsearch.training.evidence import Rows

    y = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 0], float)
    own = np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 0], bool)
    w = balance(Rows(np.zeros((10, 4)), y, own, np.zeros(10, np.int64)))
    assert w[y > 0.5].sum() == pytest.approx(w[y < 0.5].sum())
    assert w[own].sum() == pytest.approx(w[(y > 0.5) & ~own].sum())


@pytest.fixture(scope="module")
def shapes_evidence(evidence_bundle: Bundle) -> Bundle:
    """The shapes model with phrase evidence (tests/conftest_service.py `evidence_bundle`)."""
    return evidence_bundle


def test_evidence_is_stored_with_the_model(shapes_evidence: Bundle) -> None:
    scale = shapes_evidence.evidence
    assert scale is not None and scale.references.shape[0] > 0
    assert shapes_evidence.calibration is not None and shapes_evidence.calibration.evidence is not None


def test_a_shape_a_picture_lacks_is_not_found_and_one_it_holds_is(shapes_evidence: Bundle,
                                                                    shapes_model: ShapesModel) -> None:
    from fragsearch.model.embed import embed_sentence

    dev = shapes_model.dev
    images = shapes_evidence.embed_images(dev.feats)
    scale = shapes_evidence.evidence
    assert scale is not None
    holds: list[float] = []
    lacks: list[float] = []
    for shape in ("circle", "square", "triangle"):
        sent, triplets = embed_sentence(shapes_evidence, f"a {shape}")
        ev = scale.for_sentence(sent, triplets)
        assert shape in ev.things
        for k, name in enumerate(dev.names):
            has = any(o["shape"] == shape for o in shapes_model.objects[name])
            (holds if has else lacks).append(ev.found(images[k]).things[shape])
    holds_a, lacks_a = np.array(holds), np.array(lacks)
    # most pictures on the right side of FOUND, and the two kinds apart as a whole
    assert (holds_a >= FOUND).mean() >= 0.8, holds_a
    assert (lacks_a < FOUND).mean() >= 0.8, lacks_a
    assert np.median(holds_a) - np.median(lacks_a) > 0.3


def test_evidence_rows_label_own_and_other_pictures(shapes_evidence: Bundle, shapes_model: ShapesModel) -> None:
    scale = shapes_evidence.evidence
    assert scale is not None
    rows = evidence_rows(shapes_evidence, scale, shapes_model.dev, {}, others=5)
    assert rows.own.any() and (rows.y[rows.own] == 1).all()
    assert 0 < rows.y[~rows.own].mean() < 1  # other pictures: some hold the thing, some do not


def test_evidence_fitted_beside_the_part_trained_on_reads_the_words_it_taught(shapes_evidence: Bundle,
                                                                                 shapes_model: ShapesModel,
                                                                                 tmp_path: Path) -> None:
    from fragsearch.model.dataset import hold_out, load_split_data
    from fragsearch.model.parsers import make_parser

    train = load_split_data(shapes_model.data, "train", shapes_evidence.image_cfg, shapes_model.cache,
                            make_parser("spacy"))
    rest, val = hold_out(train, 20, 0)
    counts = word_counts(rest)
    # each noun counts the pictures whose captions name it, once a picture
    for word, n in counts.items():
        named = {int(k) for p, k in zip(rest.parsed, rest.pair_image, strict=True) if word in named_things(p.triplets)}
        assert n == len(named) > 0
    scale, report = fit_evidence(shapes_evidence, val, tmp_path / "no-entities", rest=rest)
    assert scale.features[-1] == "known" and scale.counts == counts
    assert len(scale.weights) == len(scale.features)
    assert report["held_out_half"]["pairs"] > 0


def test_a_model_without_evidence_reads_as_before(calibrated_engine: Engine) -> None:
    """A calibrated model made before phrase evidence: its answers carry no `found`, and every fragment without
    a positive match is left out of the alignment, as before."""
    bundle = calibrated_engine.bundle
    cal = bundle.calibration
    assert cal is not None and cal.evidence is None and bundle.evidence is None
    assert PhraseEvidence.from_state({"form": "earlier"}, np.zeros((1, 1, 1)), 1) is None
    page = calibrated_engine.images.search("a red circle", 3)
    assert page.hits and all(h.found is None for h in page.hits)
    assert all(m.found is None and m.score > 0 for h in page.hits for m in h.alignment)


def test_the_released_model_reads_its_evidence() -> None:
    from fragsearch.model.release import RELEASED_MODEL

    bundle = Bundle.load(Path(RELEASED_MODEL))
    scale = bundle.evidence
    assert scale is not None and scale.references.shape[0] == REFERENCES
    # it reads its presence head beside the references' standings, and how well it knows each word
    assert bundle.presence is not None and scale.head is bundle.presence
    assert scale.features == (*FEATURES, "presence", "known")
    assert known("dog", scale.counts) > known("giraffe", scale.counts) == 0.0
    assert bundle.relevance is not None and bundle.relevance.uses_evidence
    from fragsearch.model.embed import embed_sentence

    sent, triplets = embed_sentence(bundle, "a dog runs through the grass")
    ev = scale.for_sentence(sent, triplets)
    assert ev.things == ["dog", "grass"]


def test_a_page_of_images_is_read_in_one_product_as_each_alone() -> None:
    """The evidence and the grounder read a page of results in one product (images of as many fragments
    together, index/matches.py `aligned_all`): each image's things found and drawn as it is read alone."""
    from fragsearch.index.matches import aligned, aligned_all, read_sentence
    from fragsearch.model.embed import embed_sentence
    from fragsearch.model.release import RELEASED_MODEL

    bundle = Bundle.load(Path(RELEASED_MODEL))
    assert bundle.evidence is not None and bundle.grounder is not None
    sent, triplets = embed_sentence(bundle, "a brown dog runs through the grass with a ball")
    reading = read_sentence(bundle, sent, triplets)
    rng = np.random.default_rng(3)
    imgs, boxes = [], []
    for count in (20, 20, 12, 20, 12, 7):  # three groups of as many fragments
        v = rng.standard_normal((count, bundle.dim)).astype(np.float32)
        v[1:] += 0.8 * sent[rng.integers(0, len(sent), count - 1)] / np.linalg.norm(sent[0])  # near some
        imgs.append(v)
        corners = np.sort(rng.uniform(0, 400, (count, 2, 2)), axis=1).reshape(count, 4)  # x1 y1 x2 y2
        corners[0] = [0, 0, 400, 300]
        boxes.append(corners.astype(np.float32))
    labels: list[list[str | None]] = [[None] * len(v) for v in imgs]
    together = aligned_all(imgs, sent, triplets, boxes, bundle.blocks, labels, reading)
    assert len(together) == len(imgs)
    for img, box, label, (matches, found) in zip(imgs, boxes, labels, together, strict=True):
        alone, found_alone = aligned(img, sent, triplets, box, bundle.blocks, label, reading)
        assert found is not None and found_alone is not None
        assert found.things.keys() == found_alone.things.keys() == {"dog", "grass", "ball"}
        assert found.things == pytest.approx(found_alone.things, abs=1e-5)
        assert [(m.triplet, m.fragment) for m in matches] == [(m.triplet, m.fragment) for m in alone]
