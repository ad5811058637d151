"""Phrase evidence in the answers (model/evidence.py): over shapes pictures none of which holds a triangle, a
search for a triangle reports it not found (no region drawn, `missing`, the reason naming it) and its results
follow as weaker matches; a circle the collection holds is found, with its region. The same on /explain,
/annotate, region search and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fragsearch.model.evidence import FOUND
from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from tests.conftest import ShapesModel
from tests.conftest_service import png_bytes

pytest_plugins = ["tests.conftest_service"]

MARGIN = 0.1  # how far from FOUND a probability the tests rely on must lie


@pytest.fixture(scope="module")
def client(evidence_engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(evidence_engine.settings, engine=evidence_engine)) as c:
        yield c


def entries(result: dict[str, Any], word: str) -> list[dict[str, Any]]:
    return [m for m in result["alignment"] if word in m["words"] and m["found"] is not None]


def test_a_thing_no_picture_holds_is_not_found(client: TestClient) -> None:
    body = client.post("/search/images", json={"sentence": "a red triangle", "k": 5}).json()
    assert body["results"], body
    top = body["results"][0]
    triangle = entries(top, "triangle")
    assert triangle, top["alignment"]
    assert max(m["found"] for m in triangle) < FOUND - MARGIN, triangle  # the margin, read first
    assert all(m["box"] is None and m["fragment"] is None for m in triangle)  # no region drawn for it
    assert "triangle" in top["missing"]


def test_a_thing_the_picture_holds_is_found_with_its_region(client: TestClient, shapes_model: ShapesModel) -> None:
    body = client.post("/search/images", json={"sentence": "a red circle", "k": 3}).json()
    top = body["results"][0]
    assert any(o["shape"] == "circle" for o in shapes_model.objects[top["name"]])
    circle = entries(top, "circle")
    assert circle and min(m["found"] for m in circle) > FOUND + MARGIN, circle
    assert all(m["box"] is not None for m in circle)
    assert "circle" not in top["missing"]
    assert top["relevance"] is not None


def test_the_cut_off_names_the_missing_thing_and_keeps_the_ranking_as_weaker_matches(client: TestClient) -> None:
    found = client.post("/search/images", json={"sentence": "a red triangle", "k": 5}).json()["results"]
    assert all(r["relevance"] < 0.5 for r in found), [r["relevance"] for r in found]
    body = client.post("/search/images", json={"sentence": "a red triangle", "k": 5, "min_relevance": 0.5}).json()
    assert body["results"] == []
    assert "triangle" in (body["reason"] or ""), body["reason"]
    assert [r["id"] for r in body["weaker"]] == [r["id"] for r in found]  # the page is not empty
    assert all("triangle" in r["missing"] for r in body["weaker"])
    circle = client.post("/search/images", json={"sentence": "a red circle", "k": 5, "min_relevance": 0.5}).json()
    assert circle["results"] and circle["reason"] is None


def test_the_relevance_falls_when_a_named_thing_is_missing(client: TestClient) -> None:
    circle = client.post("/search/images", json={"sentence": "a red circle", "k": 1}).json()["results"][0]
    triangle = client.post("/search/images", json={"sentence": "a red triangle", "k": 1}).json()["results"][0]
    assert circle["relevance"] > triangle["relevance"]


def test_explain_says_what_is_not_there(client: TestClient) -> None:
    top = client.post("/search/images", json={"sentence": "a red triangle", "k": 1}).json()["results"][0]
    e = client.post("/explain", json={"image_id": top["id"], "sentence": "a red triangle"}).json()
    assert "triangle" in e["missing"]
    assert all(m["box"] is None for m in entries(e, "triangle"))
    assert e["pairs"] and all(p["box"] is not None for p in e["pairs"])  # every pair keeps its region
    assert e["relevance"] == pytest.approx(top["relevance"], abs=1e-4)


def test_annotate_and_region_search_carry_the_evidence(client: TestClient) -> None:
    body = client.post("/annotate", files={"file": ("red.png", png_bytes(224, 224), "image/png")},
                       data={"k": "3"}).json()
    assert body["results"]
    assert any(m["found"] is not None for r in body["results"] for m in r["alignment"])
    regions = client.post("/search/fragments", json={"phrase": "a red circle", "k": 3}).json()["results"]
    assert regions and all(r["found"] is not None for r in regions)


def test_the_command_line_says_it_too(evidence_engine: Engine, tmp_path: Any) -> None:
    settings = evidence_engine.settings
    args = ["--image-index", str(settings.image_index), "--model-path", str(settings.model_path)]
    out = subprocess.run([sys.executable, "-m", "fragsearch", "search", "a red triangle", "--k", "3", "--json",
                          "--min-relevance", "0.5", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and out.stdout, (out.stdout, out.stderr[-2000:])  # nothing reaches the cut-off
    body = json.loads(out.stdout)
    assert body["results"] == [] and body["weaker"] and "triangle" in body["reason"]
    text = subprocess.run([sys.executable, "-m", "fragsearch", "search", "a red triangle", "--k", "3",
                           "--min-relevance", "0.5", *args], capture_output=True, text=True, timeout=300)
    assert text.stdout == ""  # stdout holds what reaches the cut-off: nothing
    lines = text.stderr.splitlines()
    at = next(n for n, line in enumerate(lines) if "weaker matches" in line)
    assert "triangle" in lines[at - 1]  # the reason, then the weaker matches
    weaker = lines[at + 1 :]
    assert len(weaker) == 3 and all("not found: triangle" in w for w in weaker), weaker
