"""The released model's recipe, the `full-2x256` variant (two runs of `full` at h = 256 merged, each member's
S_kl thresholded apart; `full`: int8 per-region crops, proposals at 112 px, contextual word vectors, the
whole-sentence fragment, score calibration), named with FRAGSEARCH_VARIANT and so trained from nothing
on 12 images of the shapes collection as `python -m service` prepares a missing variant, and answering
every ranked route over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from fastapi.testclient import TestClient

from model.bundle import Bundle
from model.data import load_split
from model.dataset import feature_cache
from model.fragments import SENTENCE_REL
from model.release import read_manifest
from service.app import create_app

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

LIMIT = 12  # images of each split prepared: the model trains on 12 images for the variant's epochs


@pytest.mark.parametrize("service_env", ["faiss"], indirect=True)  # one training is enough: the model is under test
def test_a_named_variant_is_trained_indexed_and_served(service_env: ServiceEnv, tmp_path: Path) -> None:
    shapes = service_env.shapes
    settings = service_env.settings_for(tmp_path, model_path=None, image_index=None, sentence_index=None,
                                        limit=LIMIT, variant="full-2x256")
    assert settings.model_path == tmp_path / "models" / "full-2x256" / "model.pt", "a variant of one's own"
    assert read_manifest()["name"] == "full-2x256", "the released model's recipe"
    with TestClient(create_app(settings, prepare=True)) as c:
        ready = service_env.prepared(c)
        assert ready["images"] == LIMIT and ready["sentences"] == 5 * LIMIT
        bundle = Bundle.load(settings.model_path)
        cfg, text = bundle.image_cfg, bundle.text.cfg
        assert bundle.meta["variant"] == "full-2x256" and not bundle.is_global
        assert (bundle.blocks, bundle.dim) == (2, 512), "two members of h = 256 side by side"
        assert [p.name for p in sorted(settings.model_path.parent.glob("member-*"))] == ["member-1", "member-2"]
        assert (cfg.region_features, cfg.backbone_precision, cfg.proposal_resize) == ("crop", "int8", 112)
        assert text.word_vectors == "contextual" and text.sentence_fragment
        assert bundle.calibration is not None

        sentence = "a red circle beside a blue square"
        hits = c.post("/search/images", json={"sentence": sentence, "k": 5}).json()["results"]
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

        explained = c.post("/explain", json={"image_id": hits[0]["id"], "sentence": sentence}).json()
        assert explained["rank"] == 1 and explained["score"] == pytest.approx(hits[0]["score"], abs=1e-5)
        upload = {"file": ("x.jpg", dev.image_path(dev.images[0]).read_bytes(), "image/jpeg")}
        annotated = c.post("/annotate", files=upload, data={"k": "5"})
        assert annotated.status_code == 200, annotated.text
        assert len(annotated.json()["results"]) == 5 and all(h["alignment"] for h in annotated.json()["results"])
        similar = c.post("/search/similar", data={"image_id": hits[0]["id"], "k": 3})
        assert similar.status_code == 200, similar.text
        assert len(similar.json()["results"]) == 3 and similar.json()["described_by"]
        regions = c.post("/search/fragments", json={"phrase": "red circle", "k": 3})
        assert regions.status_code == 200 and len(regions.json()["results"]) == 3
