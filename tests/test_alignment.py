"""bench.alignment (the pointing game) and tools/imagenet_nouns.py (its noun → ImageNet classes file)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.alignment import (
    Alignments,
    NounClasses,
    Trial,
    extra_rates,
    largest_region,
    model_alignments,
    pointing_rates,
    rates_row,
    top_classes,
    verified,
    wilson95,
    with_wilson,
)
from fragsearch.model.image import region_crops
from tests.conftest import ShapesModel
from tools.imagenet_nouns import build, read_synsets

# -- the noun → classes file ------------------------------------------------------------------------


def test_the_shipped_nouns_map_words_to_their_imagenet_kinds() -> None:
    nouns = NounClasses.load()
    assert nouns.noun_of("dogs") == nouns.noun_of("puppy") == "dog"
    assert nouns.noun_of("bike") == "bicycle"
    assert nouns.noun_of("man") is None  # people: ImageNet-1k cannot verify them
    assert nouns.noun_of("kite") is None  # the toy has no ImageNet-1k class (class 21 is the bird)
    dog, cat = nouns.classes["dog"], nouns.classes["cat"]
    assert set(range(151, 269)) == dog  # the 118 dog breeds, nothing else
    assert 281 in cat and 207 not in cat and not dog & cat  # tabby is a cat, golden retriever is not
    assert {805, 852, 890} <= nouns.classes["ball"]  # soccer ball, tennis ball, volleyball
    assert all(0 <= c < 1000 for cs in nouns.classes.values() for c in cs)


def test_a_triplet_naming_two_nouns_is_verified_by_either() -> None:
    nouns = NounClasses({"dog": frozenset({1, 2}), "ball": frozenset({7})}, {"dog": "dog", "dogs": "dog",
                                                                           "ball": "ball"})
    assert nouns.nouns_in(("dogs", "ball")) == ("dog", "ball")
    assert nouns.nouns_in(("dog", "dogs")) == ("dog",)
    assert nouns.nouns_in(("runs", "grass")) == ()
    assert nouns.targets(("dog", "ball")) == {1, 2, 7}


def test_a_word_listed_for_two_nouns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nouns.json"
    path.write_text(json.dumps({"nouns": [{"noun": "boat", "words": ["ship"], "classes": [1]},
                                          {"noun": "ship", "words": ["ship"], "classes": [2]}]}))
    with pytest.raises(ValueError, match="two nouns"):
        NounClasses.load(path)


WORDNET_DATA = """\
  1 This software and database is being provided to you, the LICENSEE, by Princeton University
00000100 03 n 01 animal 0 002 ~ 00000200 n 0000 ~ 00000500 n 0000 | a living organism
00000200 05 n 02 dog 0 domestic_dog 0 002 @ 00000100 n 0000 ~ 00000300 n 0000 | a member of the genus Canis
00000300 05 n 01 poodle 0 002 @ 00000200 n 0000 ~i 00000400 n 0000 | an intelligent dog
00000400 05 n 01 Fido 0 001 @i 00000300 n 0000 | one poodle
00000500 05 n 01 cat 0 001 @ 00000100 n 0000 | feline mammal
00000600 06 n 01 dog 1 000 | a dull unattractive unpleasant girl or woman
"""
WORDNET_INDEX = """\
  1 This software and database is being provided to you, the LICENSEE, by Princeton University
animal n 1 1 ~ 1 0 00000100
cat n 1 1 @ 1 0 00000500
dog n 2 2 @ ~ 2 1 00000200 00000600
poodle n 1 2 @ ~i 1 0 00000300
"""


def test_the_mapping_is_the_hyponym_closure_of_the_chosen_sense(tmp_path: Path) -> None:
    (tmp_path / "data.noun").write_text(WORDNET_DATA)
    (tmp_path / "index.noun").write_text(WORDNET_INDEX)
    synsets = read_synsets(tmp_path / "data.noun")
    assert synsets[200].lemmas == ("dog", "domestic_dog") and synsets[300].hyponyms == (400,)
    wnids = {0: "n00000400", 1: "n00000300", 2: "n00000600", 3: "n00000100"}
    names = {0: "Fido", 1: "poodle, French poodle", 2: "frump", 3: "animal"}
    out = build(tmp_path, wnids, names, {"dog": ("dog.n.01", ("dog", "dogs")), "cat": ("cat.n.01", ("cat",)),
                                         "frump": ("dog.n.02", ("frump",))})
    mapped = {n["noun"]: n for n in out["nouns"]}  # type: ignore[attr-defined]
    assert mapped["dog"]["classes"] == [0, 1]  # poodle and, through the instance pointer, Fido; not animal
    assert mapped["dog"]["class_names"] == ["Fido", "poodle"]
    assert mapped["frump"]["classes"] == [2]  # the second sense is a different synset
    assert [n["noun"] for n in out["left_out"]] == ["cat"]  # type: ignore[attr-defined]


# -- the counting ----------------------------------------------------------------------------------


def _game() -> tuple[np.ndarray, np.ndarray, list[Trial], NounClasses]:
    """Two images of three fragments (whole image, two regions); each fragment's top-2 classes."""
    top = np.array([
        [[5, 9], [1, 5], [9, 8]],  # image 0: the whole image says 5 then 9, region 1 says 1 (a dog)
        [[9, 1], [8, 9], [2, 8]],  # image 1: only the whole image has a dog, in 2nd place; region 2 a cat
    ])
    boxes = np.array([
        [[0, 0, 10, 10], [0, 0, 5, 5], [0, 0, 8, 8]],  # region 2 is the larger
        [[0, 0, 10, 10], [0, 0, 6, 6], [0, 0, 6, 6]],  # a tie: the first region
    ], dtype=np.float32)
    nouns = NounClasses({"dog": frozenset({1}), "cat": frozenset({2})}, {"dog": "dog", "cat": "cat"})
    trials = [Trial(0, 1, ("dog",)), Trial(0, 2, ("dog",)), Trial(1, 2, ("cat",)), Trial(1, 1, ("dog", "cat"))]
    return top, boxes, trials, nouns


def test_verified_fragments_at_top1_and_top2() -> None:
    top, _, trials, nouns = _game()
    assert verified(top, trials, nouns, 1).tolist() == [
        [False, True, False], [False, True, False], [False, False, True], [False, False, True]]
    assert verified(top, trials, nouns, 2).tolist() == [
        [False, True, False], [False, True, False], [False, False, True], [True, False, True]]


def test_the_top_classes_are_the_largest_logits_best_first_a_tie_to_the_lower_class() -> None:
    logits = np.array([[0.1, 3.0, -2.0, 3.0, 1.5], [5.0, 4.0, 3.0, 2.0, 1.0]], np.float32)
    assert top_classes(logits, 3).tolist() == [[1, 3, 4], [0, 1, 2]]
    rng = np.random.default_rng(0)
    many = rng.standard_normal((8, 1000)).astype(np.float32)
    softmax = np.exp(many - many.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    np.testing.assert_array_equal(top_classes(many, 5), np.argsort(-softmax, axis=1)[:, :5])  # the softmax's order


def test_largest_region_skips_the_whole_image_and_takes_the_first_on_ties() -> None:
    _, boxes, _, _ = _game()
    assert largest_region(boxes[0]) == 2
    assert largest_region(boxes[1]) == 1


def test_pointing_rates_of_the_model_and_the_baselines_on_a_known_case() -> None:
    top, boxes, trials, nouns = _game()
    ok = verified(top, trials, nouns, 2)
    r = pointing_rates(ok, np.array([t.fragment for t in trials]), np.array([2, 2, 1, 1]))
    assert r["model"] == pytest.approx(2 / 4)  # trials 0 and 2 hit; 1 and 3 chose unverified regions
    assert r["random"] == pytest.approx((1 / 3 + 1 / 3 + 1 / 3 + 2 / 3) / 4)
    assert r["largest"] == pytest.approx(0.0)  # region 2 of image 0, region 1 of image 1: never verified
    assert r["whole"] == pytest.approx(1 / 4)
    assert r["any"] == pytest.approx(1.0)
    row = rates_row(trials, top, boxes, nouns)  # the same at top-5 (only two predictions given)
    assert row["trials"] == 4 and row["model_top5"] == 50.0 and row["whole_top5"] == 25.0
    assert row["largest_top1"] == 0.0 and row["on_whole"] == 0.0
    assert (row["model_top5_low95"], row["model_top5_high95"]) == (15.0, 85.0)  # Wilson's for 2 of 4
    assert math.isnan(pointing_rates(ok[:0], np.zeros(0, np.int64), np.zeros(0, np.int64))["model"])


@pytest.mark.parametrize(("hits", "n", "low", "high"), [
    (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634), (1, 20, 0.0089, 0.2361),
    (4621, 6278, 0.7250, 0.7468),
])
def test_the_pointing_rate_interval_is_wilsons(hits: int, n: int, low: float, high: float) -> None:
    """Wilson's score interval (published values); the normal approximation gives 0 % ± 0 for 0 of 10 and
    goes below 0 for 1 of 20 (5 % ± 9.6)."""
    assert wilson95(hits / n, n) == pytest.approx((low, high), abs=6e-5)
    assert all(math.isnan(x) for x in wilson95(0.0, 0))


def test_a_kept_row_with_the_old_half_width_gets_the_bounds() -> None:
    old = {"model": "full", "trials": "6278", "model_top1": "52.9", "model_top1_ci95": "1.2",
           "model_top5": "73.6", "model_top5_ci95": "1.1"}
    row = with_wilson(old)
    assert "model_top5_ci95" not in row and (row["model_top5_low95"], row["model_top5_high95"]) == (72.5, 74.7)


def test_pointing_without_the_whole_image_and_without_dogs_on_a_known_case() -> None:
    top, _, trials, nouns = _game()
    al = Alignments(trials, 0, 0, region_trials=[Trial(0, 1, ("dog",)), Trial(1, 1, ("cat",))])
    row = extra_rates(al, top, nouns)
    # regions only, top-1: trial (0, 1, dog) is verified, (1, 1, cat) is not; a random region: 1/2 each
    assert row["regions_trials"] == 2 and row["regions_model_top1"] == 50.0 and row["regions_random_top1"] == 50.0
    # no dog: the one cat trial, aligned to its verified fragment 2 (top-1), 1 of its 3 fragments verified
    assert row["nondog_trials"] == 1 and row["nondog_model_top1"] == 100.0 and row["nondog_random_top1"] == 33.3
    assert row["nondog_regions_trials"] == 1 and row["nondog_regions_model_top1"] == 0.0


def test_region_crops_show_the_box() -> None:
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # right half blue
    crops = region_crops(img, np.array([[20, 0, 40, 20], [0, 0, 20, 20]], np.float32), 8)
    assert crops.shape == (2, 3, 8, 8)
    inner = crops[:, :, 2:6, 2:6]  # away from the edges, where bilinear filtering may read past the box
    assert inner[0, 2].min() > 0.9 and inner[0, 0].max() < -0.9  # blue, no red
    assert inner[1, 0].min() > 0.9 and inner[1, 2].max() < -0.9


# -- on a trained model -----------------------------------------------------------------------------


def test_the_shapes_model_points_at_the_shapes_it_names(shapes_model: ShapesModel) -> None:
    """The pointing game on the synthetic shapes, with the drawn shapes as the "classifier": a fragment
    "predicts" the shape it lies on (tests.synthetic.points_at, as in the end-to-end alignment test;
    class = the shape's index), else nothing (99)."""
    from tests.synthetic import SHAPES, points_at

    bundle, dev = shapes_model.bundle, shapes_model.dev
    nouns = NounClasses({s: frozenset({i}) for i, s in enumerate(SHAPES)}, {s: s for s in SHAPES})
    top = np.full((*dev.boxes.shape[:2], 5), 99, dtype=np.int16)
    for k, name in enumerate(dev.names):
        a, b = ([float(v) for v in o["box"]] for o in shapes_model.objects[name])  # type: ignore[attr-defined]
        shape_a, shape_b = (SHAPES.index(str(o["shape"])) for o in shapes_model.objects[name])
        for f, box in enumerate(dev.boxes[k].tolist()):
            if points_at(box, a, b):
                top[k, f, 0] = shape_a
            elif points_at(box, b, a):
                top[k, f, 0] = shape_b
    al = model_alignments(bundle, dev, nouns, calibrated=False, cache=shapes_model.cache)
    assert al.sentence_fragments == 0  # the paper's configuration has no whole-sentence fragment
    assert {n for t in al.trials for n in t.nouns} == set(SHAPES)
    assert any(len(t.nouns) == 2 for t in al.trials)  # prep_beside(circle, square): either shape verifies
    row = rates_row(al.trials, top, dev.boxes, nouns)
    assert row["model_top1"] > 1.5 * row["random_top1"]  # on the named shape, well above chance
