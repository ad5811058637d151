"""The watched folder: with a collection served, a photo dropped into the folder becomes searchable, a
moved one follows, a deleted one disappears, without a restart; /readyz and /metrics show the watcher."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi.testclient import TestClient

from fragsearch.index import IndexSettings
from fragsearch.index.sync import open_index, sync_folder
from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from tests.conftest_service import make_settings
from tests.synthetic import make_picture

if TYPE_CHECKING:
    from tests.conftest import ShapesModel

BOUND = 180.0  # seconds a change may take to be applied on a busy machine (a bound, not a speed measured)


def picture(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    make_picture(random.Random(seed))[0].save(path, "JPEG", quality=90)


def names(c: TestClient) -> set[str]:
    r = c.post("/search/images", json={"sentence": "a red circle", "k": 40})
    assert r.status_code == 200, r.text
    return {x["name"] for x in r.json()["results"]}


def until(c: TestClient, check: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not check(names(c)):
        assert time.monotonic() < deadline, f"{what} within {BOUND:.0f}s: {c.get('/readyz').json()}"
        time.sleep(0.2)


def test_the_served_folder_is_followed_while_serving(shapes_model: ShapesModel, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    for n in range(3):
        picture(photos / f"p{n}.jpg", n)
    settings = make_settings(shapes_model, tmp_path, collection=photos, image_index=tmp_path / "index",
                             watch_debounce_ms=200, watch_rescan=3600.0)
    index = open_index(settings.image_index, shapes_model.bundle, photos, settings.cache, IndexSettings())
    sync_folder(index, photos)  # what the start-up does
    engine = Engine(settings, shapes_model.bundle, index, None)
    with TestClient(create_app(settings, engine=engine)) as c:
        assert names(c) == {"p0.jpg", "p1.jpg", "p2.jpg"}
        watch = c.get("/readyz").json()["watch"]
        assert watch["folder"] == str(photos.resolve()) and watch["backlog"] == 0

        picture(photos / "new" / "dropped.jpg", 7)
        until(c, lambda found: "dropped.jpg" in found, "a dropped photo is searchable")
        (photos / "notes.txt").write_text("not a photo")  # ignored by the watcher's filter

        shutil.move(photos / "p1.jpg", photos / "new" / "moved.jpg")
        until(c, lambda found: "moved.jpg" in found and "p1.jpg" not in found, "a moved photo is followed")

        (photos / "p0.jpg").unlink()
        until(c, lambda found: "p0.jpg" not in found, "a deleted photo disappears")
        assert names(c) == {"p2.jpg", "dropped.jpg", "moved.jpg"}

        ready = c.get("/readyz").json()
        assert ready["images"] == 3 and ready["watch"]["syncs"] >= 3 and ready["watch"]["backlog"] == 0
        assert ready["watch"]["watching"] is True and ready["watch"]["last_error"] is None
        assert "fragsearch_watch_backlog 0.0" in c.get("/metrics").text
    # the changes were saved: a restart finds them without syncing
    assert len(type(index).load(settings.image_index, shapes_model.bundle, collection_root=photos)) == 3
