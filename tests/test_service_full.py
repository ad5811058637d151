"""The released model's recipe, the `full-2x256` variant (two runs of `full` at h = 256 merged, each member's
S_kl thresholded apart; `full`: int8 per-region crops, proposals at 112 px, contextual word vectors, the
whole-sentence fragment, score calibration), named with FRAGSEARCH_VARIANT and so trained from nothing
on 12 images of the shapes collection as `python -m fragsearch.service` prepares a missing variant, and answering
every ranked route over a real socket (uvicorn on 127.0.0.1, an ephemeral port).

A collection of 12 images is far below `IndexSettings.exact_below` (50,000 fragments), under which every
search is the exact scan of every item; the app that answers the routes loads the prepared indexes with
`exact_below` 0, so that each search goes through FAISS's candidates (k' = 128 for the images, every
positive fragment for the sentences) and the exact re-rank, as on a collection above the limit; its
/metrics show that the candidates answered every ranked route and the scan none."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import torch

from fragsearch.index import ImageIndex, SentenceIndex
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.fragments import SENTENCE_REL
from fragsearch.model.release import read_manifest
from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from tests.uvicorn_thread import uvicorn_server

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

LIMIT = 12  # images of each split prepared: the model trains on 12 images for the variant's epochs
PREPARED_WITHIN = 900.0  # seconds for training both members and building both indexes on 2 cores
REQUEST_TIMEOUT = 120.0  # seconds for one answer


def prepared(http: httpx.Client) -> dict[str, Any]:
    """GET /readyz until the preparing app is ready (every answer before says it is preparing)."""
    deadline = time.monotonic() + PREPARED_WITHIN
    while (r := http.get("/readyz")).status_code != 200:
        assert r.json()["status"] == "preparing", r.json()
        assert time.monotonic() < deadline, f"not prepared within {PREPARED_WITHIN:.0f} s: {r.json()}"
        time.sleep(0.2)
    body: dict[str, Any] = r.json()
    return body


def searched(http: httpx.Client) -> dict[tuple[str, str], float]:
    """fragsearch_index_searches_total of /metrics: (index, path) -> searches answered."""
    pattern = r'^fragsearch_index_searches_total\{index="(\w+)",path="(\w+)"\} (\S+)$'
    return {(index, path): float(n) for index, path, n in re.findall(pattern, http.get("/metrics").text, re.M)}


@pytest.mark.parametrize("service_env", ["faiss"], indirect=True)  # one training is enough: the model is under test
def test_a_named_variant_is_trained_indexed_and_served(service_env: ServiceEnv, tmp_path: Path) -> None:
    shapes = service_env.shapes
    settings = service_env.settings_for(tmp_path, model_path=None, image_index=None, sentence_index=None,
                                        limit=LIMIT, variant="full-2x256")
    assert settings.model_path == tmp_path / "models" / "full-2x256" / "model.pt", "a variant of one's own"
    assert read_manifest()["name"] == "full-2x256", "the released model's recipe"
    with uvicorn_server(create_app(settings, prepare=True)) as base, \
            httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT) as http:
        ready = prepared(http)
    assert ready["images"] == LIMIT and ready["sentences"] == 5 * LIMIT
    bundle = Bundle.load(settings.model_path)
    cfg, text = bundle.image_cfg, bundle.text.cfg
    assert bundle.meta["variant"] == "full-2x256" and not bundle.is_global
    assert (bundle.blocks, bundle.dim) == (2, 512), "two members of h = 256 side by side"
    assert [p.name for p in sorted(settings.model_path.parent.glob("member-*"))] == ["member-1", "member-2"]
    assert (cfg.region_features, cfg.backbone_precision, cfg.proposal_resize) == ("crop", "int8", 112)
    assert text.word_vectors == "contextual" and text.sentence_fragment
    assert bundle.calibration is not None

    # the prepared indexes, searched through their candidates
    images = ImageIndex.load(settings.image_index, bundle, collection_root=settings.collection_root, exact_below=0)
    sentences = SentenceIndex.load(settings.sentence_index, bundle, exact_below=0)
    assert images.settings.search.k_prime > 0 and sentences.settings.search.k_prime == 0
    engine = Engine(settings, bundle, images, sentences)
    with uvicorn_server(create_app(settings, engine=engine)) as base, \
            httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT) as http:
        before = searched(http)
        sentence = "a red circle beside a blue square"
        hits = http.post("/search/images", json={"sentence": sentence, "k": 5}).json()["results"]
        assert len(hits) == 5 and [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        relations = {m["relation"] for h in hits for m in h["alignment"]}  # a model of 12 images: over the top 5
        assert SENTENCE_REL in relations and "amod" in relations, "triplets and the whole sentence align"
        # the served score is S_kl of the calibrated fragments (each image's and the sentence's scale)
        dev = load_split(shapes.data, "dev")
        feats, _ = feature_cache(settings.cache, cfg).load_arrays([dev.image_path(hits[0]["name"])])
        enc = bundle.text.encode([sentence])
        with torch.inference_mode():
            img, sent = bundle.embed_images(feats), bundle.embed_sentences(enc)
            raw = bundle.embed_images(feats, calibrated=False), bundle.embed_sentences(enc, calibrated=False)
        ones = torch.ones(img.shape[:2])
        assert hits[0]["score"] == pytest.approx(float(bundle.scores(img, ones, *sent)[0, 0]), rel=1e-4)
        assert hits[0]["score"] != pytest.approx(float(bundle.scores(raw[0], ones, *raw[1])[0, 0]), rel=1e-2)

        explained = http.post("/explain", json={"image_id": hits[0]["id"], "sentence": sentence}).json()
        assert explained["rank"] == 1 and explained["score"] == pytest.approx(hits[0]["score"], abs=1e-5)
        upload = {"file": ("x.jpg", dev.image_path(dev.images[0]).read_bytes(), "image/jpeg")}
        annotated = http.post("/annotate", files=upload, data={"k": "5"})
        assert annotated.status_code == 200, annotated.text
        assert len(annotated.json()["results"]) == 5 and all(h["alignment"] for h in annotated.json()["results"])
        similar = http.post("/search/similar", data={"image_id": hits[0]["id"], "k": 3})
        assert similar.status_code == 200, similar.text
        assert len(similar.json()["results"]) == 3 and similar.json()["described_by"]
        regions = http.post("/search/fragments", json={"phrase": "red circle", "k": 3})
        assert regions.status_code == 200 and len(regions.json()["results"]) == 3
        after = searched(http)
    for index, routes in (("images", 3), ("sentences", 2)):  # images: search, explain, fragments
        assert after.get((index, "scan"), 0.0) == before.get((index, "scan"), 0.0), f"the scan answered on {index}"
        assert after[index, "candidates"] - before.get((index, "candidates"), 0.0) == routes, index
    images.close()
    sentences.close()
