"""The API on the coloured-shapes index: results, alignments, health, metrics, OpenAPI, settings."""

from __future__ import annotations

import gc
import io
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw

from fragsearch.index import ImageIndex, IndexLoadError, IndexSettings, SentenceIndex
from fragsearch.model.bundle import Bundle
from fragsearch.model.release import RELEASED_MODEL
from fragsearch.model.text import Triplet
from fragsearch.service.app import STATIC, create_app
from fragsearch.service.engine import Engine
from fragsearch.service.prepare import prepare
from fragsearch.settings import Settings
from fragsearch.training.nets.checkpoint import Checkpoint

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]


def _inside(box: list[float], width: int, height: int) -> bool:
    x0, y0, x1, y1 = box
    eps = 1e-3
    return -eps <= x0 <= x1 <= width + eps and -eps <= y0 <= y1 <= height + eps


def test_health_and_ready(client: TestClient, service_env: ServiceEnv) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["images"] == len(service_env.dev)
    assert ready.json()["sentences"] == len(service_env.engine.sentences or [])


def test_search_finds_the_described_image_with_alignments(client: TestClient, service_env: ServiceEnv) -> None:
    in_top5 = 0
    for name in service_env.dev:
        r = client.post("/search/images", json={"sentence": service_env.captions[name][0], "k": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        scores = [h["score"] for h in body["results"]]
        assert len(scores) == 5 and scores == sorted(scores, reverse=True)
        in_top5 += name in [h["name"] for h in body["results"]]
        top = body["results"][0]
        assert top["url"] == f"/images/{top['id']}"
        assert top["alignment"], "every result carries its fragment alignment"
        for m in top["alignment"]:
            assert _inside(m["box"], top["width"], top["height"])
            assert len(m["words"]) == 2 and m["relation"] and m["triplet"]
            assert m["phrase"] == Triplet(m["relation"], *m["words"]).phrase(), "the triplet read as words"
    # 20 dev images: chance of the right one in the top 5 is 25 %
    assert in_top5 >= 0.6 * len(service_env.dev)


def test_result_image_is_served(client: TestClient) -> None:
    hit = client.post("/search/images", json={"sentence": "a red circle beside a blue square", "k": 1}).json()
    r = client.get(hit["results"][0]["url"])
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    assert r.content[:2] == b"\xff\xd8"


def test_annotate_ranks_the_images_own_captions_high(client: TestClient, service_env: ServiceEnv) -> None:
    name = service_env.dev[0]
    r = client.post("/annotate", files={"file": ("x.jpg", service_env.jpeg(name), "image/jpeg")}, data={"k": "10"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"]) == (224, 224)
    texts = [h["text"] for h in body["results"]]
    assert len(texts) == 10
    assert set(texts) & set(service_env.captions[name]), "one of the image's own captions is in the top 10"
    for hit in body["results"]:
        for m in hit["alignment"]:
            assert _inside(m["box"], body["width"], body["height"])


def test_annotate_boxes_are_in_the_uploads_pixels(client: TestClient, service_env: ServiceEnv) -> None:
    wide = service_env.png(400, 100)
    r = client.post("/annotate", files={"file": ("wide.png", wide, "image/png")}, data={"k": "3"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"]) == (400, 100)
    boxes = [m["box"] for h in body["results"] for m in h["alignment"]]
    assert boxes and all(_inside(b, 400, 100) for b in boxes)


def test_an_upload_sent_again_is_answered_from_its_kept_regions(writable: tuple[TestClient, Engine],
                                                                service_env: ServiceEnv) -> None:
    """The same bytes again (a second look, the next page, a "more like this") are not extracted again: the
    answers are the same and the model's recent uploads count the hits; other bytes are extracted."""
    client, engine = writable
    def fresh() -> bytes:  # a file of the same picture that no earlier request sent
        buf = io.BytesIO()
        Image.open(io.BytesIO(service_env.jpeg(service_env.dev[0]))).save(buf, "JPEG", comment=f"{time.time_ns()}")
        return buf.getvalue()

    jpeg = fresh()
    calls = []
    extract = engine.bundle.extractor.extract
    hits = engine.bundle.recent_uploads.hits

    def counted(image: Any) -> Any:
        calls.append(1)
        return extract(image)

    engine.bundle.extractor.extract = counted  # type: ignore[method-assign]
    try:
        first = client.post("/annotate", files={"file": ("a.jpg", jpeg, "image/jpeg")}, data={"k": "4"}).json()
        again = client.post("/annotate", files={"file": ("b.jpg", jpeg, "image/jpeg")}, data={"k": "4"}).json()
        page = client.post("/annotate", files={"file": ("a.jpg", jpeg, "image/jpeg")},
                           data={"k": "2", "offset": "2"}).json()
        similar = client.post("/search/similar", files={"file": ("a.jpg", jpeg, "image/jpeg")}, data={"k": "2"})
        assert similar.status_code == 200, similar.text
        assert len(calls) == 1
        other = client.post("/annotate", files={"file": ("c.jpg", fresh(), "image/jpeg")}, data={"k": "2"})
        assert other.status_code == 200 and len(calls) == 2
    finally:
        engine.bundle.extractor.extract = extract  # type: ignore[method-assign]
    assert [r["text"] for r in again["results"]] == [r["text"] for r in first["results"]]
    assert [r["alignment"] for r in again["results"]] == [r["alignment"] for r in first["results"]]
    assert [r["text"] for r in page["results"]] == [r["text"] for r in first["results"]][2:4]
    assert (again["width"], again["height"]) == (first["width"], first["height"])
    assert engine.bundle.recent_uploads.hits - hits == 3


def test_recent_entries_keep_the_last_ones() -> None:
    from fragsearch.model.recent import Recent

    kept: Recent[str] = Recent(limit=2)
    for key in ("a", "b"):
        kept.put(key, key.upper())
    assert kept.get("a") == "A"  # "a" is now the most recent
    kept.put("c", "C")
    assert kept.get("b") is None and kept.get("a") == "A" and kept.get("c") == "C"
    assert len(kept) == 2 and (kept.hits, kept.misses) == (3, 1)


def test_a_camera_sized_jpeg_is_read_at_the_models_side_and_answered_in_its_own_pixels(
        client: TestClient) -> None:
    img = Image.new("RGB", (224, 112), "white")
    draw = ImageDraw.Draw(img)
    draw.ellipse((130, 20, 200, 90), fill=(220, 20, 20))
    buf = io.BytesIO()
    img.resize((1920, 960), Image.Resampling.BILINEAR).save(buf, format="JPEG", quality=85)
    r = client.post("/annotate", files={"file": ("camera.jpg", buf.getvalue(), "image/jpeg")}, data={"k": "3"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"]) == (1920, 960)  # the photo's size, not the size it was read at
    boxes = [m["box"] for h in body["results"] for m in h["alignment"]]
    assert boxes and all(_inside(b, 1920, 960) for b in boxes)
    assert max(b[2] for b in boxes) > 1024  # in the photo's pixels (the circle is in its right half)


def test_fragment_search_by_phrase_and_triplet(client: TestClient) -> None:
    r = client.post("/search/fragments", json={"phrase": "red circle", "k": 5})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 5
    assert [h["score"] for h in results] == sorted((h["score"] for h in results), reverse=True)
    assert all(_inside(h["box"], 224, 224) for h in results)
    t = client.post("/search/fragments", json={"triplet": {"relation": "amod", "w1": "circle", "w2": "red"}, "k": 3})
    assert t.status_code == 200, t.text
    assert t.json()["query"] == "amod(circle, red)" and len(t.json()["results"]) == 3


def test_fragment_search_needs_exactly_one_query(client: TestClient) -> None:
    for body in ({"k": 3}, {"phrase": "red circle", "triplet": {"relation": "amod", "w1": "circle", "w2": "red"}}):
        r = client.post("/search/fragments", json=body)
        assert r.status_code == 422 and "exactly one" in r.json()["error"]["message"]


def test_k_larger_than_the_collection_returns_what_exists(client: TestClient, service_env: ServiceEnv) -> None:
    r = client.post("/search/images", json={"sentence": "a green triangle", "k": service_env.settings.k_max})
    assert r.status_code == 200
    assert 0 < len(r.json()["results"]) <= len(service_env.dev)


def test_upload_then_search_then_delete(writable: tuple[TestClient, Engine], service_env: ServiceEnv) -> None:
    c, engine = writable
    before = c.get("/readyz").json()["images"]
    jpeg = service_env.jpeg(service_env.dev[3])
    key = {"X-API-Key": service_env.api_key}
    r = c.post("/images", files={"file": ("../../evil name.jpg", jpeg, "image/jpeg")}, headers=key)
    assert r.status_code == 201, r.text
    added = r.json()
    assert added["name"] == "evil name.jpg" and (added["width"], added["height"]) == (224, 224)
    assert c.get("/readyz").json()["images"] == before + 1
    got = c.get(added["url"])
    assert got.status_code == 200 and got.headers["content-type"] == "image/jpeg"
    stored = list(engine.settings.uploads.iterdir())
    assert len(stored) == 1 and stored[0].suffix == ".jpg", "the upload is stored under a name of the service's"
    caption = service_env.captions[service_env.dev[3]][0]
    names = [h["name"] for h in c.post("/search/images", json={"sentence": caption, "k": 5}).json()["results"]]
    assert "evil name.jpg" in names, "the upload is searchable at once"
    d = c.delete(f"/images/{added['id']}", headers={"X-API-Key": service_env.api_key})
    assert d.status_code == 204
    assert c.get(added["url"]).status_code == 404
    assert c.get("/readyz").json()["images"] == before
    assert c.delete(f"/images/{added['id']}", headers={"X-API-Key": service_env.api_key}).status_code == 404


def test_writes_persist_across_a_restart(service_env: ServiceEnv, tmp_path) -> None:
    settings, engine = service_env.writable(tmp_path)
    with TestClient(create_app(settings, engine=engine)) as c:
        r = c.post("/images", files={"file": ("a.png", service_env.png(64, 48), "image/png")},
                   headers={"X-API-Key": service_env.api_key})
        assert r.status_code == 201
        new_id = r.json()["id"]
    index = ImageIndex.load(tmp_path / "images", service_env.shapes.bundle)
    assert index.get(new_id) is not None and len(index) == len(service_env.dev) + 1


def test_auth_can_only_be_switched_off_explicitly(service_env: ServiceEnv, tmp_path) -> None:
    settings, engine = service_env.writable(tmp_path / "nokey", api_key=None)
    with TestClient(create_app(settings, engine=engine)) as c:
        upload = {"file": ("a.png", service_env.png(32, 32), "image/png")}
        assert c.post("/images", files=upload).status_code == 401
        refused = c.post("/images", files=upload, headers={"X-API-Key": "anything"})
        assert refused.status_code == 403 and "no API key" in refused.json()["error"]["message"]
    settings, engine = service_env.writable(tmp_path / "open", api_key=None, auth_disabled=True)
    with TestClient(create_app(settings, engine=engine)) as c:
        assert c.post("/images", files={"file": ("a.png", service_env.png(32, 32), "image/png")}).status_code == 201


def test_thumbnails_come_in_a_few_sizes_and_are_made_once(client: TestClient, service_env: ServiceEnv) -> None:
    top = client.post("/search/images", json={"sentence": "a red circle", "k": 1}).json()["results"][0]
    assert top["thumbnail"] == f"/images/{top['id']}/thumbnail?size=256"
    folder = service_env.settings.thumbnails_dir
    shutil.rmtree(folder, ignore_errors=True)  # the cache is shared by the tests of both backends
    before: set[Path] = set()
    r = client.get(f"/images/{top['id']}/thumbnail", params={"size": 100})
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    thumb = Image.open(io.BytesIO(r.content))
    scale = 128 / max(top["width"], top["height"])  # 100 is served at the next size, 128; aspect kept
    assert max(thumb.size) == 128
    assert abs(thumb.size[0] - top["width"] * scale) <= 1 and abs(thumb.size[1] - top["height"] * scale) <= 1
    made = set(folder.glob("*.jpg")) - before
    assert len(made) == 1
    again = client.get(f"/images/{top['id']}/thumbnail", params={"size": 128})
    assert again.content == r.content and set(folder.glob("*.jpg")) - before == made, "the cached file is served"
    big = Image.open(io.BytesIO(client.get(f"/images/{top['id']}/thumbnail", params={"size": 4000}).content))
    assert max(big.size) == min(512, max(top["width"], top["height"])), "never above 512, never enlarged"
    default = Image.open(io.BytesIO(client.get(f"/images/{top['id']}/thumbnail").content))
    assert max(default.size) == min(256, max(top["width"], top["height"]))
    for bad in (0, -5, 4097, "big"):
        e = client.get(f"/images/{top['id']}/thumbnail", params={"size": bad})
        assert e.status_code == 422 and e.json()["error"]["code"], (bad, e.text)
    missing = client.get("/images/999999/thumbnail")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_explain_gives_the_score_rank_and_every_pairs_share(client: TestClient, service_env: ServiceEnv) -> None:
    sentence = service_env.captions[service_env.dev[0]][0]
    hits = client.post("/search/images", json={"sentence": sentence, "k": 3}).json()["results"]
    for place, hit in enumerate(hits, start=1):
        r = client.post("/explain", json={"image_id": hit["id"], "sentence": sentence})
        assert r.status_code == 200, r.text
        e = r.json()
        assert e["rank"] == place and e["images"] == len(service_env.dev)
        assert e["scope"] == "candidates" and e["recalled"]  # ranked among the candidates: every image
        assert abs(e["score"] - hit["score"]) < 1e-5
        assert e["alignment"] == hit["alignment"]
        pairs = e["pairs"]
        assert len(pairs) == e["image_fragments"] * e["sentence_fragments"]
        assert abs(sum(p["contribution"] for p in pairs) - e["score"]) < 1e-5
        assert all(p["cleared"] == (p["score"] > 0) and (p["contribution"] > 0) == p["cleared"] for p in pairs)
        for m in e["alignment"]:  # each aligned region is its triplet's best pair
            mine = [p for p in pairs if p["triplet"] == m["triplet"]]
            assert max(p["score"] for p in mine) == pytest.approx(m["score"], abs=1e-5)
    missing = client.post("/explain", json={"image_id": 999999, "sentence": sentence})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    for body in ({"image_id": hits[0]["id"], "sentence": "  "}, {"image_id": -1, "sentence": sentence},
                 {"image_id": "1", "sentence": sentence}, {"sentence": sentence}):
        assert client.post("/explain", json=body).status_code == 422, body


def _pairs(captions: list[str]) -> set[str]:
    """The "colour shape" phrases the shapes captions name."""
    words = " ".join(captions).split()
    return {f"{a} {b}" for a, b in zip(words, words[1:], strict=False)
            if a in ("red", "blue", "green", "yellow") and b in ("circle", "square", "triangle")}


def test_similar_images_ranked_by_mean_fragments_and_explained_by_descriptions(client: TestClient,
                                                                 service_env: ServiceEnv) -> None:
    ids = {h["name"]: h["id"] for h in client.post("/search/images", json={
        "sentence": "a red circle", "k": len(service_env.dev)}).json()["results"]}
    shared = 0
    for name in service_env.dev:
        r = client.post("/search/similar", data={"image_id": ids[name], "k": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["image_id"] == ids[name] and body["width"] > 0
        assert 1 <= len(body["described_by"]) <= 5
        results = body["results"]
        assert len(results) == 3 and ids[name] not in [h["id"] for h in results], "the query is left out"
        assert [h["score"] for h in results] == sorted((h["score"] for h in results), reverse=True)
        assert all(h["alignment"] for h in results), "each result shows which described triplets it matched"
        shared += bool(_pairs(service_env.captions[name]) & _pairs(service_env.captions[results[0]["name"]]))
    # two of twelve colour-shape pairs per picture: another picture shares one with p ~ 0.3 by chance
    assert shared >= 0.6 * len(service_env.dev), shared

    name = service_env.dev[0]
    upload = service_env.image_path(name).read_bytes()
    r = client.post("/search/similar", files={"file": ("q.jpg", upload, "image/jpeg")}, data={"k": "5"})
    assert r.status_code == 200, r.text
    assert r.json()["image_id"] is None and r.json()["described_by"] and len(r.json()["results"]) == 5
    # an upload is not left out: a copy of an indexed image finds it among the first (of 20)
    assert name in [h["name"] for h in r.json()["results"]]

    both = client.post("/search/similar", files={"file": ("q.jpg", upload, "image/jpeg")},
                       data={"image_id": ids[name]})
    for bad in (both, client.post("/search/similar", data={"k": 3})):
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "one_query"
    assert client.post("/search/similar", data={"image_id": 999999}).status_code == 404
    assert client.post("/search/similar", data={"image_id": ids[name], "k": 0}).status_code == 422
    assert client.post("/search/similar", data={"image_id": "x"}).status_code == 422


def test_pages_of_results(client: TestClient, service_env: ServiceEnv) -> None:
    def search(k: int, offset: int) -> dict:
        r = client.post("/search/images", json={"sentence": "a red circle beside a blue square", "k": k,
                                                 "offset": offset})
        assert r.status_code == 200, r.text
        return r.json()

    whole, first, second = search(6, 0), search(3, 0), search(3, 3)
    assert [h["id"] for h in first["results"] + second["results"]] == [h["id"] for h in whole["results"]]
    assert (first["offset"], first["next_offset"], second["offset"], second["next_offset"]) == (0, 3, 3, 6)
    n = len(service_env.dev)
    assert first["considered"] == n  # the candidates: every image
    last = search(3, n - 2)
    assert len(last["results"]) == 2 and last["next_offset"] is None
    assert search(3, n)["results"] == []
    deep = client.post("/search/images", json={"sentence": "a red circle", "k": 5, "offset": 999})
    assert deep.status_code == 422 and deep.json()["error"]["code"] == "bad_offset"
    assert client.post("/search/images", json={"sentence": "a red circle", "offset": -1}).status_code == 422

    upload = service_env.image_path(service_env.dev[0]).read_bytes()

    def annotate(k: int, offset: int) -> list[int]:
        r = client.post("/annotate", files={"file": ("q.jpg", upload, "image/jpeg")}, data={"k": k, "offset": offset})
        assert r.status_code == 200, r.text
        assert r.json()["offset"] == offset and r.json()["considered"] >= k
        return [h["id"] for h in r.json()["results"]]

    assert annotate(2, 0) + annotate(2, 2) == annotate(4, 0)
    query = whole["results"][0]["id"]

    def similar(k: int, offset: int) -> list[int]:
        r = client.post("/search/similar", data={"image_id": query, "k": k, "offset": offset})
        assert r.status_code == 200, r.text
        return [h["id"] for h in r.json()["results"]]

    assert similar(2, 0) + similar(2, 2) == similar(4, 0) and query not in similar(4, 0)

    def regions(k: int, offset: int, body: dict | None = None) -> dict:
        r = client.post("/search/fragments", json={**(body or {"phrase": "red circle"}), "k": k, "offset": offset})
        assert r.status_code == 200, r.text
        return r.json()

    def keys(page: dict) -> list[tuple[int, int]]:
        return [(h["image_id"], h["fragment"]) for h in page["results"]]

    whole_r, first_r, second_r = regions(6, 0), regions(3, 0), regions(3, 3)
    assert keys(first_r) + keys(second_r) == keys(whole_r) and len(keys(whole_r)) == 6
    assert (first_r["next_offset"], second_r["offset"]) == (3, 3) and first_r["considered"] >= 6
    triplet = {"triplet": {"relation": "amod", "w1": "circle", "w2": "red"}}
    assert keys(regions(2, 0, triplet)) + keys(regions(2, 2, triplet)) == keys(regions(4, 0, triplet))
    tail = regions(5, first_r["considered"] - 2)
    assert len(tail["results"]) == 2 and tail["next_offset"] is None
    deep = client.post("/search/fragments", json={"phrase": "red circle", "k": 5, "offset": 999})
    assert deep.status_code == 422 and deep.json()["error"]["code"] == "bad_offset"


def searched(c: TestClient) -> dict[tuple[str, str], float]:
    """fragsearch_index_searches_total of /metrics: (index, path) -> searches answered."""
    text = c.get("/metrics").text
    pattern = r'^fragsearch_index_searches_total\{index="(\w+)",path="(\w+)"\} (\S+)$'
    return {(index, path): float(n) for index, path, n in re.findall(pattern, text, re.M)}


@pytest.fixture
def scan_client(service_env: ServiceEnv) -> Iterator[TestClient]:
    """An app over the same index folders at the default `exact_below`, under which collections this
    small are searched by the exact scan of every item."""
    bundle = service_env.shapes.bundle
    limit = IndexSettings().search.exact_below
    images = ImageIndex.load(service_env.root / "images", bundle, exact_below=limit)
    sentences = SentenceIndex.load(service_env.root / "sentences", bundle, exact_below=limit)
    engine = Engine(service_env.settings, bundle, images, sentences)
    with TestClient(create_app(service_env.settings, engine=engine)) as c:
        yield c
    images.close()
    sentences.close()


def test_every_ranked_route_answers_through_the_candidates_as_the_scan_does(
        client: TestClient, scan_client: TestClient, service_env: ServiceEnv) -> None:
    """The suite's app answers every ranked route from the candidate backend (FAISS or Milvus) and the
    exact re-rank, never by the scan (/metrics counts the path that answered), and answers what an app
    scanning the same collection answers (its k' recalls every item)."""
    name = service_env.dev[0]
    sentence = service_env.captions[name][0]
    upload = {"file": ("q.jpg", service_env.jpeg(name), "image/jpeg")}
    image_id = scan_client.post("/search/images", json={"sentence": sentence, "k": 3}).json()["results"][2]["id"]
    requests: list[tuple[str, dict[str, Any], set[str]]] = [  # route, request, the indexes it searches
        ("/search/images", {"json": {"sentence": sentence, "k": 10}}, {"images"}),
        ("/annotate", {"files": upload, "data": {"k": "10"}}, {"sentences"}),
        ("/explain", {"json": {"image_id": image_id, "sentence": sentence}}, {"images"}),
        # more like this ranks by mean-fragment cosines; only its explanation searches (the sentences)
        ("/search/similar", {"data": {"image_id": image_id, "k": "5"}}, {"sentences"}),
        ("/search/similar", {"files": upload, "data": {"k": "5"}}, {"sentences"}),
    ]
    # what depends on how many items were scored exactly (the candidates, or every item), and the time
    varies = ("took_ms", "considered", "next_offset", "scope", "images")
    for route, request, indexes in requests:
        before = searched(client), searched(scan_client)
        got, want = client.post(route, **request), scan_client.post(route, **request)
        after = searched(client), searched(scan_client)
        assert got.status_code == want.status_code == 200, (route, got.text, want.text)
        for index in ("images", "sentences"):
            uses = int(index in indexes)
            assert after[0][index, "scan"] == before[0][index, "scan"], f"{route}: the scan answered"
            assert after[0][index, "candidates"] - before[0][index, "candidates"] == uses, (route, index)
            assert after[1][index, "scan"] - before[1][index, "scan"] == uses, (route, index)
        assert ({k: v for k, v in got.json().items() if k not in varies}
                == {k: v for k, v in want.json().items() if k not in varies}), route
    before = searched(client)
    regions = client.post("/search/fragments", json={"phrase": "red circle", "k": 5})
    assert regions.status_code == 200 and len(regions.json()["results"]) == 5
    after = searched(client)
    assert after["images", "candidates"] - before["images", "candidates"] == 1
    assert after["images", "scan"] == before["images", "scan"]


def test_response_examples_are_valid_answers(client: TestClient) -> None:
    from fragsearch.service import schemas

    components = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("SearchImagesResponse", "AnnotateResponse", "SimilarResponse", "SearchFragmentsResponse",
                 "ExplainResponse", "ImageOut", "ErrorResponse"):
        examples = components[name].get("examples")
        assert examples, f"{name} has no example in the OpenAPI document"
        for example in examples:
            getattr(schemas, name).model_validate(example)


def test_metrics_count_requests_per_route_and_index_size(client: TestClient, service_env: ServiceEnv) -> None:
    client.post("/search/images", json={"sentence": "a blue square", "k": 2})
    client.post("/search/images", json={"sentence": "", "k": 2})
    client.get("/images/999999")
    text = client.get("/metrics").text
    assert re.search(r'fragsearch_requests_total\{method="POST",route="/search/images",status="200"\} [1-9]', text)
    assert re.search(r'fragsearch_requests_total\{method="POST",route="/search/images",status="422"\} [1-9]', text)
    assert 'route="/images/{image_id}",status="404"' in text, "routes are labelled by template, not raw path"
    assert 'fragsearch_request_seconds_bucket{le="0.03",method="POST",route="/search/images"}' in text
    assert f'fragsearch_index_size{{index="images"}} {float(len(service_env.dev))}' in text
    assert "process_resident_memory_bytes" in text
    assert re.search(r'python_gc_collections_total\{generation="2"\} \d', text)


def test_openapi_lists_every_error_response(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert "ErrorResponse" in spec["components"]["schemas"]
    expected = {
        ("/search/images", "post"): {"413", "422", "503"},
        ("/search/fragments", "post"): {"413", "422", "503"},
        ("/annotate", "post"): {"413", "415", "422", "503"},
        ("/images", "post"): {"401", "403", "413", "415", "422", "503"},
        ("/images/{image_id}", "get"): {"404", "503"},
        ("/images/{image_id}/thumbnail", "get"): {"404", "422", "503"},
        ("/images/{image_id}/duplicates", "get"): {"404", "422", "503"},
        ("/explain", "post"): {"404", "422", "503"},
        ("/search/similar", "post"): {"404", "413", "415", "422", "503"},
        ("/images/{image_id}", "delete"): {"401", "403", "404", "503"},
        ("/readyz", "get"): {"503"},
    }
    for (path, method), codes in expected.items():
        responses = spec["paths"][path][method]["responses"]
        assert codes <= set(responses), (path, method, set(responses))
        for code in codes:
            ref = responses[code]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
    assert "X-API-Key" in str(spec["components"]["securitySchemes"])


def test_not_ready_until_loaded(service_env: ServiceEnv, tmp_path) -> None:
    settings = service_env.settings_for(tmp_path, model_path=tmp_path / "missing.pt")
    with TestClient(create_app(settings)) as c:
        assert c.get("/healthz").status_code == 200
        for _ in range(200):
            r = c.get("/readyz")
            if "failed" in r.json()["error"]["message"]:
                break
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert "missing.pt" in r.json()["error"]["message"]
        s = c.post("/search/images", json={"sentence": "a red circle", "k": 1})
        assert s.status_code == 503


def wait_ready(c: TestClient) -> None:
    for _ in range(600):
        r = c.get("/readyz")
        if r.status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"not ready: {r.text}")


def test_loads_from_disk_in_the_background(service_env: ServiceEnv) -> None:
    with TestClient(create_app(service_env.settings)) as c:
        wait_ready(c)
        assert c.post("/search/images", json={"sentence": "a red circle", "k": 2}).status_code == 200


def test_loaded_objects_are_frozen_out_of_the_collector(service_env: ServiceEnv) -> None:
    gc.unfreeze()
    settings = service_env.settings.model_copy(update={"freeze_heap": True})
    try:
        with TestClient(create_app(settings)) as c:
            wait_ready(c)
            engine = c.app.state.engine  # type: ignore[attr-defined]
            frozen = gc.get_freeze_count()
            assert frozen > 1000
            # the loaded model is among the frozen objects: a full collection no longer walks it
            assert all(o is not engine for o in gc.get_objects(generation=2))
            assert c.post("/search/images", json={"sentence": "a red circle", "k": 2}).status_code == 200
    finally:
        gc.unfreeze()


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("FRAGSEARCH_K_MAX", "70")
    monkeypatch.setenv("FRAGSEARCH_ARTIFACTS", str(tmp_path))
    monkeypatch.setenv("FRAGSEARCH_API_KEY", "")
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.k_max == 70 and s.api_key is None and not s.writes_open
    assert s.model_path == RELEASED_MODEL and s.variant is None, "the released model unless a variant is named"
    monkeypatch.setenv("FRAGSEARCH_VARIANT", "paper")
    assert Settings(_env_file=None).model_path == tmp_path / "models" / "paper" / "model.pt"  # type: ignore[call-arg]
    monkeypatch.setenv("FRAGSEARCH_VARIANT", "")  # compose's empty default
    assert Settings(_env_file=None).model_path == RELEASED_MODEL  # type: ignore[call-arg]
    assert s.image_index == tmp_path / "index" / "images-dev"
    assert (s.host, s.port) == ("127.0.0.1", 8000)


def test_page_is_self_contained(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for name in ("index.html", "app.js", "style.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", text), f"{name} loads something external"
        assert "@import" not in text and "cdn" not in text.lower()
    assert client.get("/static/app.js").status_code == 200


def test_prepare_builds_what_is_missing_and_reuses_what_exists(service_env: ServiceEnv, tmp_path) -> None:
    settings = service_env.settings_for(tmp_path, image_index=None, sentence_index=None, workers=1)
    assert settings.model_path.is_file(), "the checkpoint exists, so nothing is trained"
    prepare(settings)
    images = ImageIndex.load(settings.image_index, service_env.shapes.bundle)
    sentences = SentenceIndex.load(settings.sentence_index, service_env.shapes.bundle)
    assert len(images) == len(service_env.dev)
    assert len(sentences) == 5 * 60, "the captions of the train split"
    images.close()
    sentences.close()
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "index").rglob("*") if p.is_file()}
    prepare(settings)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "index").rglob("*") if p.is_file()} == files


def test_prepare_rebuilds_indexes_built_with_another_model(service_env: ServiceEnv, tmp_path) -> None:
    model_path = tmp_path / "model.pt"
    shutil.copy(service_env.shapes.model_path, model_path)
    settings = service_env.settings_for(tmp_path, image_index=None, sentence_index=None, workers=1,
                                        model_path=model_path)
    prepare(settings)
    retrained = Checkpoint.load(model_path)
    with torch.no_grad():
        next(retrained.model.parameters()).add_(0.01)  # another checkpoint: different weights
    retrained.save(model_path)
    new = Bundle.load(model_path)
    with pytest.raises(IndexLoadError):
        ImageIndex.load(settings.image_index, new)
    prepare(settings)
    images = ImageIndex.load(settings.image_index, new)
    sentences = SentenceIndex.load(settings.sentence_index, new)
    assert len(images) == len(service_env.dev) and len(sentences) == 5 * 60
    images.close()
    sentences.close()
    assert not list((tmp_path / "index").glob("*.stale")), "the stale copies are removed once rebuilt"
