"""A global variant served like the fragment model: prepared from nothing (trained, indexed) and answering
the same routes, its alignment the whole sentence to the whole image, its score S_kl of one fragment per side."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.score import SMOOTHING
from fragsearch.service.app import create_app
from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]


@pytest.mark.parametrize("variant", ["sdt-rnn", "devise"])
def test_a_global_variant_is_trained_indexed_and_served(service_env: ServiceEnv, tmp_path: Path, variant: str) -> None:
    model_path = tmp_path / "models" / variant / "model.pt"
    settings = service_env.settings_for(tmp_path, variant=variant, model_path=model_path, limit=12,
                                        image_index=tmp_path / "index" / "images-dev",
                                        sentence_index=tmp_path / "index" / "sentences-train")
    with TestClient(create_app(settings, prepare=True)) as c:
        assert service_env.prepared(c)["images"] == 12
        bundle = Bundle.load(model_path)
        assert bundle.cfg.kind == variant and bundle.is_global and bundle.meta["variant"] == variant

        sentence = "a red circle beside a blue square"
        body = c.post("/search/images", json={"sentence": sentence, "k": 3}).json()
        hits = body["results"]
        assert hits and [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        for h in hits:  # one alignment: the whole sentence to the whole image
            (m,) = h["alignment"]
            assert m["relation"] == "<sentence>" and m["box"] == [0.0, 0.0, float(h["width"]), float(h["height"])]
        # the served score is max(0, v . s) / (1 + n), v the image's vector, s the sentence's
        dev = load_split(service_env.shapes.data, "dev")
        cache = feature_cache(service_env.shapes.cache, bundle.image_cfg)
        feats, _ = cache.load_arrays([dev.image_path(hits[0]["name"])])
        v = bundle.encoders.embed_images(np.asarray(feats[:, 0], np.float32))[0]
        s, _ = bundle.embed_sentences(bundle.text.encode([sentence]))
        assert hits[0]["score"] == pytest.approx(max(0.0, float(v @ s[0, 0])) / (1 + SMOOTHING), rel=1e-4)

        r = c.post("/annotate", files={"file": ("x.jpg", service_env.jpeg(), "image/jpeg")}, data={"k": "5"})
        assert r.status_code == 200, r.text
        for h in r.json()["results"]:
            assert [m["relation"] for m in h["alignment"]] in ([], ["<sentence>"])
        f = c.post("/search/fragments", json={"phrase": "red circle", "k": 3})
        assert f.status_code == 200, f.text
        assert all(h["box"] == [0.0, 0.0, 224.0, 224.0] for h in f.json()["results"])  # the regions: whole images
        assert c.post("/search/images", json={"sentence": "!!!", "k": 3}).status_code == 422
