"""A backend switch on prepared artifacts (FRAGSEARCH_INDEX_BACKEND=milvus over indexes built on FAISS, as
on a compose volume of an earlier start, and back): prepare rebuilds both indexes with the backend set, and
the service then loads and searches them."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from fragsearch.index.catalogue import built_backend
from fragsearch.service.app import create_app, load_engine
from fragsearch.service.prepare import prepare
from tests.conftest import ShapesModel
from tests.conftest_service import make_settings


def test_prepare_rebuilds_the_indexes_of_another_backend(shapes_model: ShapesModel, tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    settings = {b: make_settings(shapes_model, root, index_backend=b, limit=8) for b in ("faiss", "milvus")}
    indexes = (root / "images", root / "sentences")
    for backend in ("faiss", "milvus", "faiss"):
        prepare(settings[backend])
        assert [built_backend(p) for p in indexes] == [backend, backend]
        assert not [p for p in root.iterdir() if p.name.endswith(".stale")]  # set aside, then removed
        engine = load_engine(settings[backend])
        with TestClient(create_app(settings[backend], engine=engine)) as c:
            r = c.post("/search/images", json={"sentence": "a red circle", "k": 3})
            assert r.status_code == 200 and len(r.json()["results"]) == 3, r.text
        engine.images.close()
        if engine.sentences is not None:
            engine.sentences.close()
    assert built_backend(tmp_path / "nowhere") is None
