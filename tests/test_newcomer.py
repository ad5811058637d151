"""The README's path on the default a fresh clone has, on the tests' small data: the released model
served (nothing trained) -> a search with `min_relevance` -> `./run index DIR` with no --model -> that
folder served -> searched; and one's own photos served with no data set at all."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pillow_heif
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from fragsearch.commands.index_sync import main as sync_main
from fragsearch.model.data import load_split
from fragsearch.model.release import RELEASED_MODEL
from fragsearch.service.app import create_app

pillow_heif.register_heif_opener()

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

LIMIT = 8  # dev images indexed and training images whose captions form the sentence collection
SENTENCE = "a red circle beside a blue square"


DATES = {1: "2021:05:01 10:00:00", 2: "2024:07:14 10:30:00", 3: "2019:12:24 09:00:00"}  # photo number -> taken


def photo_folder(service_env: ServiceEnv, folder: Path, n: int) -> Path:
    """A folder of one's own photos: the first `n` dev images of the shapes collection (the first in a
    subfolder, three with an EXIF date, the last as HEIC), beside what a sync leaves out: a NAS thumbnail
    folder, a trash folder and a folder the folder's .fragsearchignore names."""
    dev = load_split(service_env.shapes.data, "dev")
    for sub in ("trip", "@eaDir", ".Trash-1000", "Screenshots"):
        (folder / sub).mkdir(parents=True)
    for k, name in enumerate(dev.images[:n]):
        img = Image.open(dev.image_path(name)).convert("RGB")
        if k == n - 1:
            img.save(folder / (Path(name).stem + ".heic"), "HEIF", quality=90)
            continue
        exif = Image.Exif()
        if k in DATES:
            exif.get_ifd(0x8769)[36867] = DATES[k]
        img.save(folder / ("trip" if k == 0 else ".") / name, "JPEG", quality=95, exif=exif)
    for sub in ("@eaDir", ".Trash-1000", "Screenshots"):
        shutil.copy(dev.image_path(dev.images[0]), folder / sub / "copy.jpg")
    (folder / ".fragsearchignore").write_text("# screenshots are not photos\nScreenshots/\n")
    return folder


@pytest.mark.parametrize("service_env", ["faiss"], indirect=True)
def test_the_readme_path_on_the_released_model(service_env: ServiceEnv, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FRAGSEARCH_MODEL_PATH", "FRAGSEARCH_VARIANT"):
        monkeypatch.delenv(name, raising=False)
    artifacts = tmp_path / "artifacts"
    settings = service_env.settings_for(artifacts, model_path=None, image_index=None, sentence_index=None,
                                        limit=LIMIT)
    assert settings.model_path == RELEASED_MODEL and settings.variant is None, "the default serves the release"
    with TestClient(create_app(settings, prepare=True)) as c:
        ready = service_env.prepared(c)
        assert ready["images"] == LIMIT and ready["sentences"] == 5 * LIMIT
        assert not (artifacts / "models").exists(), "the first start trains nothing"
        found = c.post("/search/images", json={"sentence": SENTENCE, "k": LIMIT}).json()
        assert len(found["results"]) == LIMIT
        relevance = [h["relevance"] for h in found["results"]]
        assert all(r is not None and 0.0 <= r <= 1.0 for r in relevance), "a relevance on every result"
        cut = sorted(relevance)[LIMIT // 2]
        kept = c.post("/search/images", json={"sentence": SENTENCE, "k": LIMIT, "min_relevance": cut})
        assert kept.status_code == 200, kept.text
        assert [h["relevance"] >= cut for h in kept.json()["results"]] == [True] * len(kept.json()["results"])
        assert 0 < len(kept.json()["results"]) < LIMIT and kept.json()["min_relevance"] == cut
        upload = {"file": ("x.jpg", service_env.jpeg(), "image/jpeg")}
        annotated = c.post("/annotate", files=upload, data={"k": "3"})
        assert annotated.status_code == 200 and all(h["relevance"] is not None for h in annotated.json()["results"])

    # ./run index DIR: no --model, the served default (the environment names none)
    photos = photo_folder(service_env, tmp_path / "Pictures", 5)
    monkeypatch.setenv("FRAGSEARCH_ARTIFACTS", str(artifacts))
    assert sync_main([str(photos), "--cache", str(settings.cache), "--workers", "1"]) == 0
    mine = service_env.settings_for(artifacts, model_path=None, image_index=None, sentence_index=None,
                                    collection=photos, watch=False, limit=LIMIT)
    with TestClient(create_app(mine, prepare=True)) as c:
        ready = service_env.prepared(c)
        assert ready["images"] == 5, "the folder's index, made by ./run index, served as it is"
        hits = c.post("/search/images", json={"sentence": SENTENCE, "k": 5}).json()["results"]
        assert len(hits) == 5 and all(h["relevance"] is not None for h in hits)
        # ready["images"] == 5: the four photos at the top and the one in trip/; not the NAS, trash and ignored
        # folders' copies
        assert not any(h["name"] == "copy.jpg" for h in hits)
        # the results above a cut-off, newest photo first, undated ones last
        cut = min(h["relevance"] for h in hits)
        by_date = c.post("/search/images", json={"sentence": SENTENCE, "k": 5, "min_relevance": cut,
                                                 "sort": "taken"})
        assert by_date.status_code == 200, by_date.text
        taken = [h["taken"] for h in by_date.json()["results"]]
        assert taken[:3] == ["2024-07-14T10:30:00", "2021-05-01T10:00:00", "2019-12-24T09:00:00"]
        assert taken[3:] == [None, None]
        assert c.post("/search/images", json={"sentence": SENTENCE, "sort": "taken"}).status_code == 422
        # a HEIC original reaches the browser as a JPEG of its size; ?original=true gives the file itself
        heic = next(h for h in hits if h["name"].endswith(".heic"))
        shown = c.get(f"/images/{heic['id']}")
        assert shown.status_code == 200 and shown.headers["content-type"] == "image/jpeg"
        assert Image.open(io.BytesIO(shown.content)).size == (heic["width"], heic["height"])
        raw = c.get(f"/images/{heic['id']}", params={"original": "true"})
        assert raw.status_code == 200 and raw.content == (photos / heic["name"]).read_bytes()


@pytest.mark.parametrize("service_env", ["faiss"], indirect=True)
def test_own_photos_are_served_without_a_data_set(service_env: ServiceEnv, tmp_path: Path) -> None:
    photos = photo_folder(service_env, tmp_path / "Pictures", 6)
    absent = tmp_path / "no-flickr8k"
    settings = service_env.settings_for(tmp_path / "artifacts", data=absent, model_path=None, image_index=None,
                                        sentence_index=None, collection=photos, watch=False)
    assert not settings.has_sentences
    with TestClient(create_app(settings, prepare=True)) as c:
        ready = service_env.prepared(c)
        assert ready["images"] == 6 and ready["sentences"] == 0
        hits = c.post("/search/images", json={"sentence": SENTENCE, "k": 3}).json()["results"]
        assert len(hits) == 3 and all(h["relevance"] is not None for h in hits)
        first = hits[0]["id"]
        assert c.post("/search/fragments", json={"phrase": "red circle", "k": 2}).status_code == 200
        similar = c.post("/search/similar", data={"image_id": first, "k": 2})
        assert similar.status_code == 200 and len(similar.json()["results"]) == 2
        assert c.get(f"/images/{first}/duplicates").status_code == 200
        explained = c.post("/explain", json={"image_id": first, "sentence": SENTENCE})
        assert explained.status_code == 200 and explained.json()["rank"] == 1
        upload = {"file": ("x.jpg", service_env.jpeg(), "image/jpeg")}
        refused = c.post("/annotate", files=upload, data={"k": "3"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_sentences"
        assert "FRAGSEARCH_CAPTIONS" in refused.json()["error"]["message"]

    captions = tmp_path / "captions.txt"
    captions.write_text("a red circle\n\na blue square beside a green triangle\nthree yellow shapes\n")
    with_captions = service_env.settings_for(tmp_path / "artifacts", data=absent, model_path=None,
                                             image_index=None, sentence_index=tmp_path / "artifacts" / "mine",
                                             collection=photos, watch=False, captions=captions)
    with TestClient(create_app(with_captions, prepare=True)) as c:
        assert service_env.prepared(c)["sentences"] == 3
        answered = c.post("/annotate", files=upload, data={"k": "3"})
        assert answered.status_code == 200, answered.text
        assert {h["text"] for h in answered.json()["results"]} <= {"a red circle", "three yellow shapes",
                                                                   "a blue square beside a green triangle"}
