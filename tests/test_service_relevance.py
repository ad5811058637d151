"""The relevance scale on the API: every ranked image and sentence carries it, `min_relevance` cuts the
list, an empty list says why; a model without the scale serves without it and refuses a cut-off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from fragsearch.model.data import load_split
from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from tests.conftest import ShapesModel
from tests.conftest_service import engine_over_dev

pytest_plugins = ["tests.conftest_service"]

SENTENCE = "a red circle"


@pytest.fixture(scope="module")
def calibrated(calibrated_engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(calibrated_engine.settings, engine=calibrated_engine)) as c:
        yield c


@pytest.fixture(scope="module")
def uncalibrated(shapes_model: ShapesModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    engine = engine_over_dev(shapes_model, shapes_model.bundle, tmp_path_factory.mktemp("no-relevance"))
    with TestClient(create_app(engine.settings, engine=engine)) as c:
        yield c


def test_every_result_carries_its_relevance_in_rank_order(calibrated: TestClient) -> None:
    body = calibrated.post("/search/images", json={"sentence": SENTENCE, "k": 20}).json()
    rel = [r["relevance"] for r in body["results"]]
    assert len(rel) == 20 and all(0.0 <= v <= 1.0 for v in rel)
    assert rel == sorted(rel, reverse=True)  # the scale increases with S_kl
    assert rel[0] > rel[-1]
    assert body["min_relevance"] is None and body["reason"] is None
    assert calibrated.get("/readyz").json()["relevance"] is True


def test_a_results_relevance_is_the_scale_for_its_query_in_the_collection(calibrated: TestClient,
                                                                         calibrated_engine: Engine) -> None:
    """A result's relevance reads the query's best scores in the collection searched and its size
    (model.calibration Relevance.for_query): the same on every page, and what the model's scale gives over all
    the collection's scores for that sentence."""
    whole = calibrated.post("/search/images", json={"sentence": SENTENCE, "k": 6}).json()["results"]
    fourth = calibrated.post("/search/images", json={"sentence": SENTENCE, "k": 1, "offset": 3}).json()["results"]
    assert fourth[0]["id"] == whole[3]["id"] and fourth[0]["relevance"] == whole[3]["relevance"]
    held = len(calibrated_engine.images)
    page = calibrated_engine.images.search(SENTENCE, held, exhaustive=True)
    scale = calibrated_engine.bundle.relevance
    assert scale is not None and page.collection == held == len(page.hits)
    rel = scale.for_query("search", [h.score for h in page.hits])  # every score of the collection: its size
    assert [r["relevance"] for r in whole] == pytest.approx([rel.of(h.score) for h in page.hits[:6]], abs=1e-4)


def test_min_relevance_keeps_the_results_that_reach_it(calibrated: TestClient) -> None:
    full = calibrated.post("/search/images", json={"sentence": SENTENCE, "k": 20}).json()["results"]
    cut = (full[2]["relevance"] + full[-1]["relevance"]) / 2
    body = calibrated.post("/search/images", json={"sentence": SENTENCE, "k": 20, "min_relevance": cut}).json()
    expect = [r["id"] for r in full if r["relevance"] >= cut]
    assert [r["id"] for r in body["results"]] == expect and 3 <= len(expect) < 20
    assert [r["id"] for r in body["weaker"]] == [r["id"] for r in full if r["relevance"] < cut]  # the rest
    assert body["min_relevance"] == cut and body["reason"] is None and body["next_offset"] is None


def test_no_good_match_is_an_empty_list_with_a_reason(calibrated: TestClient) -> None:
    best = calibrated.post("/search/images", json={"sentence": SENTENCE, "k": 1}).json()["results"][0]["relevance"]
    if best >= 0.9999:
        pytest.fail(f"the best result's relevance {best} leaves no room above it for the test")
    r = calibrated.post("/search/images", json={"sentence": SENTENCE, "k": 5, "min_relevance": min(1.0, best + 1e-4)})
    assert r.status_code == 200
    body = r.json()
    assert body["results"] == []
    assert body["reason"].startswith("no good match: no image reaches relevance")
    # the ranking is not hidden: it follows as weaker matches, and its next page is there
    assert len(body["weaker"]) == 5 and body["next_offset"] == 5


def test_annotate_takes_the_cut_off_too(calibrated: TestClient, shapes_model: ShapesModel) -> None:
    name = load_split(shapes_model.data, "dev").images[0]
    data = (shapes_model.data / "images" / name).read_bytes()
    full = calibrated.post("/annotate", files={"file": ("a.jpg", data)}, data={"k": "10"}).json()["results"]
    assert all(0.0 <= s["relevance"] <= 1.0 for s in full)
    cut = full[4]["relevance"]
    body = calibrated.post("/annotate", files={"file": ("a.jpg", data)},
                           data={"k": "10", "min_relevance": str(cut)}).json()
    assert [s["id"] for s in body["results"]] == [s["id"] for s in full if s["relevance"] >= cut]


def test_a_model_without_the_scale_serves_without_it_and_refuses_a_cut_off(uncalibrated: TestClient) -> None:
    body = uncalibrated.post("/search/images", json={"sentence": SENTENCE, "k": 3}).json()
    assert [r["relevance"] for r in body["results"]] == [None, None, None]
    assert uncalibrated.get("/readyz").json()["relevance"] is False
    r = uncalibrated.post("/search/images", json={"sentence": SENTENCE, "min_relevance": 0.5})
    assert r.status_code == 422 and r.json()["error"]["code"] == "no_relevance_scale"


@pytest.mark.parametrize("value", [-0.1, 1.5, "high"])
def test_a_bad_cut_off_is_a_422(calibrated: TestClient, value: object) -> None:
    r = calibrated.post("/search/images", json={"sentence": SENTENCE, "min_relevance": value})
    assert r.status_code == 422 and "min_relevance" in r.text


def best_relevance(client: TestClient, sentence: str) -> float:
    """The relevance of the best image for `sentence`, with no cut-off."""
    results = client.post("/search/images", json={"sentence": sentence, "k": 1}).json()["results"]
    return float(results[0]["relevance"])


def test_the_default_cut_off_answers_no_good_match_for_what_the_collection_does_not_hold(
        calibrated: TestClient, shapes_model: ShapesModel) -> None:
    """A sentence about two shapes that no collection picture holds together (each is in some picture, with
    another shape) gets "no good match" at the page's default cut-off, while a picture's own caption finds
    pictures there.

    The model is trained in the session, and its training follows the CPU's arithmetic (AVX2, AVX-512, AMX
    round differently), so one fixed sentence can land on either side of the cut-off. The test takes its cases
    with a margin and checks the margin first: the absent sentence whose best relevance is lowest, the own
    caption whose best is highest (ties by text), each at least MARGIN from the cut-off. Then the cut-off's
    outcome on the page is what is tested: an empty list with its reason, and results."""
    import json

    from fragsearch.model.calibration import DEFAULT_CUTOFF
    from tests.synthetic import COLOURS, SHAPES

    margin = 0.1
    objects = json.loads((shapes_model.data / "objects.json").read_text())
    dev = load_split(shapes_model.data, "dev")
    pairs = {frozenset(((a["colour"], a["shape"]), (b["colour"], b["shape"])))
             for name in dev.images for a, b in [objects[Path(name).name]]}
    absent = [f"a {c1} {s1} beside a {c2} {s2}" for c1 in sorted(COLOURS) for s1 in SHAPES for c2 in sorted(COLOURS)
              for s2 in SHAPES if c1 != c2 and s1 != s2 and frozenset(((c1, s1), (c2, s2))) not in pairs]
    assert len(absent) >= 20, absent
    lowest = min((best_relevance(calibrated, s), s) for s in absent)
    own = max((best_relevance(calibrated, c), c) for captions in dev.captions[:5] for c in captions)
    assert lowest[0] <= DEFAULT_CUTOFF - margin, f"no absent sentence clears the margin below the cut-off: {lowest}"
    assert own[0] >= DEFAULT_CUTOFF + margin, f"no own caption clears the margin above the cut-off: {own}"

    body = calibrated.post("/search/images", json={"sentence": lowest[1], "k": 5,
                                                   "min_relevance": DEFAULT_CUTOFF}).json()
    assert body["results"] == [] and body["reason"].startswith("no good match"), body
    found = calibrated.post("/search/images", json={"sentence": own[1], "k": 5,
                                                    "min_relevance": DEFAULT_CUTOFF}).json()
    assert found["results"], found


def test_a_page_is_shown_through_one_composition_on_both_sides(calibrated_engine: Engine) -> None:
    """`shown` reads a page's relevance against its collection and cuts it: the same hits, in ranking order,
    as the relevance of each result read by hand; each side names its own item in the reason."""
    from fragsearch.model.calibration import Relevance
    from fragsearch.service.routes.convert import shown, shown_relevance

    engine = calibrated_engine
    page = engine.images.search(SENTENCE, 8)
    view = shown(engine.bundle, "images", page, None)
    assert view.hits == page.hits and view.weaker == [] and view.cut == {"min_relevance": None, "reason": None}
    assert isinstance(view.relevance, Relevance)
    values = [shown_relevance(h.score, view.relevance, h.found) for h in page.hits]
    middle = sorted(values)[len(values) // 2]
    cut = shown(engine.bundle, "images", page, middle)
    assert [h.image_id for h in cut.hits] == [h.image_id for h, v in zip(page.hits, values, strict=True) if v >= middle]
    assert [h.image_id for h in cut.weaker] == [h.image_id for h, v in zip(page.hits, values, strict=True)
                                                if v < middle]
    above = max(values) + 1e-3  # a cut-off no result reaches (the margin checked first)
    assert above <= 1.0, f"the shapes model shows a relevance of {max(values)}: no cut-off lies above it"
    refused = shown(engine.bundle, "images", page, above)
    assert refused.hits == [] and refused.weaker == page.hits
    assert "no good match" in str(refused.cut["reason"]) and "image" in str(refused.cut["reason"])
    assert engine.sentences is not None
    from PIL import Image

    annotated = engine.sentences.annotate(Image.new("RGB", (64, 64), (200, 30, 30)), 5)
    read = shown(engine.bundle, "sentences", annotated, None)
    assert read.relevance is not None and read.hits == annotated.hits
    best = max(shown_relevance(h.score, read.relevance, h.found) for h in annotated.hits)
    assert best + 1e-3 <= 1.0, f"the shapes model shows a relevance of {best}: no cut-off lies above it"
    none = shown(engine.bundle, "sentences", annotated, best + 1e-3)
    assert none.hits == [] and none.weaker == annotated.hits and "sentence" in str(none.cut["reason"])
