"""Preparation while serving: progress on /readyz, searches before annotation, and indexes that move
with their collection (image paths relative to the data folder)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import psutil
from fastapi.testclient import TestClient
from tqdm import tqdm

from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.build import build_image_index
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.service.app import create_app
from fragsearch.service.prepare import STAGES, Progress, _Relayed
from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]


def test_progress_reads_the_step_under_way_from_its_progress_bar() -> None:
    progress = Progress()
    progress.enter("image index")
    with tqdm(total=10, desc="indexing images", disable=False) as bar:
        time.sleep(0.2)
        bar.update(4)
        snap = progress.snapshot()
    assert snap["stage"] == "image index" and snap["step"] == "indexing images"
    assert (snap["done"], snap["total"]) == (4, 10)
    assert snap["eta_seconds"] is not None and snap["eta_seconds"] > 0
    assert snap["stages_left"] == ["sentence index", "loading"]
    after = progress.snapshot()  # the bar is closed: no step counts
    assert after["done"] is None and after["total"] is None
    assert "image index" in progress.line()
    progress.finish()
    assert progress.snapshot()["stage"] == "ready" and progress.snapshot()["stages_left"] == []


def test_an_index_moves_with_its_collection(service_env: ServiceEnv, tmp_path: Path) -> None:
    shapes = service_env.shapes
    bundle = shapes.bundle
    dev = load_split(shapes.data, "dev")
    paths = [dev.image_path(n) for n in dev.images[:6]]
    cache = feature_cache(shapes.cache, bundle.image_cfg)
    outside = tmp_path / "elsewhere" / "upload.jpg"
    outside.parent.mkdir()
    shutil.copy(paths[0], outside)
    index = build_image_index(bundle, [*paths, outside], tmp_path / "index" / "images", IndexSettings(), cache=cache,
                              collection_root=shapes.data)
    first = index.photos.find([paths[1]])[str(paths[1])]
    assert index.photos.stored_path(paths[1]) == f"images/{paths[1].name}"
    assert index.photos.stored_path(outside) == str(outside)  # outside the collection: absolute
    index.close()
    # the collection and the index mounted elsewhere (as in a container): every file is found there
    moved = tmp_path / "mounted"
    (moved / "images").mkdir(parents=True)
    for p in paths:
        shutil.copy(p, moved / "images" / p.name)
    shutil.copytree(tmp_path / "index", tmp_path / "index-moved")
    again = ImageIndex.load(tmp_path / "index-moved" / "images", bundle, collection_root=moved)
    rec = again.get(first)
    assert rec is not None and rec.path == str(moved.resolve() / "images" / paths[1].name)
    assert all(Path(h.path).is_file() for h in again.search("a red circle", 7).hits)
    assert again.photos.find([moved / "images" / paths[2].name])  # the same image, seen at its new place
    again.close()


def test_serves_while_preparing_and_says_how_far_it_got(service_env: ServiceEnv, tmp_path: Path) -> None:
    """A checkpoint and no indexes: /healthz at once, /readyz 503 with the stage until both indexes are
    built, then 200; the page's data comes from the same answers."""
    settings = service_env.settings_for(tmp_path, variant="paper", image_index=tmp_path / "index" / "images-dev",
                                        sentence_index=tmp_path / "index" / "sentences-train", limit=12)
    app = create_app(settings, prepare=True)
    seen: list[dict] = []
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        first = c.get("/readyz")
        assert first.status_code == 503 and first.json()["status"] == "preparing"
        assert first.json()["error"]["code"] == "not_ready"
        deadline = time.monotonic() + 300
        while True:
            r = c.get("/readyz")
            if r.status_code == 200:
                break
            body = r.json()
            assert body["status"] == "preparing", body
            seen.append(body["progress"])
            assert time.monotonic() < deadline, "preparation did not finish"
            time.sleep(0.05)
        assert r.json()["images"] == 12
        assert r.json()["sentences"] == 60  # the 5 captions of the first 12 training images
        assert c.post("/search/images", json={"sentence": "a red circle", "k": 2}).status_code == 200
        assert c.post("/annotate", files={"file": ("x.jpg", service_env.jpeg(), "image/jpeg")}).status_code == 200
    stages = {p["stage"] for p in seen}
    assert stages <= {"starting", *STAGES}, stages
    assert (tmp_path / "index" / "images-dev" / "index.sqlite").is_file()
    child = app.state.preparation  # built in a process of its own, which ended when it was done
    assert child.pid is not None and child.pid != os.getpid() and child.exitcode == 0


def test_a_child_preparing_reports_its_stages_and_its_progress_bar() -> None:
    """What the service shows of a preparation in its child process: the stages it enters (logged once, by the
    child) and the bar of the step under way, read in the child and followed here."""
    import queue

    events: queue.Queue[tuple[object, ...]] = queue.Queue()
    child = _Relayed(events)
    child.enter("image index", "indexing 12 images")
    assert events.get_nowait() == ("enter", "image index", "indexing 12 images")
    with tqdm(total=10, desc="extracting", disable=False) as bar:
        bar.update(3)
        state = Progress.bar_state()
    assert state is not None and (state["step"], state["done"], state["total"]) == ("extracting", 3, 10)
    service = Progress()
    service.enter("image index", "indexing 12 images", log=False)
    service.follow(state)
    snap = service.snapshot()
    assert (snap["stage"], snap["step"], snap["done"], snap["total"]) == ("image index", "extracting", 3, 10)
    service.enter("sentence index", log=False)  # a new stage forgets the last one's bar
    assert service.snapshot()["done"] is None


def test_stopping_the_service_while_it_prepares_ends_the_child(service_env: ServiceEnv, tmp_path: Path) -> None:
    """The service stops during its first preparation: the child process building the indexes ends with it
    (nothing is left running), and the next start prepares what is missing."""
    settings = service_env.settings_for(tmp_path, variant="paper", image_index=tmp_path / "index" / "images-dev",
                                        sentence_index=tmp_path / "index" / "sentences-train", limit=12)
    app = create_app(settings, prepare=True)
    with TestClient(app) as c:
        deadline = time.monotonic() + 120
        while app.state.preparation.pid is None:
            assert time.monotonic() < deadline, "no child process started"
            time.sleep(0.05)
        pid = app.state.preparation.pid
        assert psutil.pid_exists(pid)
        assert c.get("/readyz").status_code == 503
    assert app.state.preparation.exitcode is not None, "the child ended with the service"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert app.state.load_error is None, "a stop is not a failure"
    with TestClient(create_app(settings, prepare=True)) as c:
        service_env.prepared(c, timeout=300)
        assert c.get("/readyz").json()["images"] == 12


def test_readiness_reports_a_failed_preparation(service_env: ServiceEnv, tmp_path: Path) -> None:
    settings = service_env.settings_for(tmp_path, data=tmp_path / "no-data", image_index=tmp_path / "i",
                                        sentence_index=tmp_path / "s")
    with TestClient(create_app(settings, prepare=True)) as c:
        for _ in range(400):
            r = c.get("/readyz")
            if r.json()["status"] == "failed":
                break
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "no-data" in r.json()["error"]["message"]
        assert c.get("/healthz").status_code == 200


def test_serves_a_photo_collection_synced_at_every_start(service_env: ServiceEnv, tmp_path: Path) -> None:
    """FRAGSEARCH_COLLECTION: the folder's photos are indexed on the first start and synced at the next."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in service_env.dev[:3]:
        shutil.copy(service_env.image_path(name), photos / name)
    settings = service_env.settings_for(tmp_path, collection=photos, image_index=None,
                                        sentence_index=tmp_path / "sentences")
    assert settings.image_index.name.startswith("collection-photos-")

    def serve() -> list[str]:
        app = create_app(settings, prepare=True)
        with TestClient(app) as c:
            service_env.prepared(c, timeout=300)
            hits = c.post("/search/images", json={"sentence": "a red circle", "k": 10}).json()["results"]
            assert all(c.get(h["url"]).status_code == 200 for h in hits), "files are served from the folder"
        # each start is a process of its own: the next one's preparation (a child process) finds the collection's
        # index free, as it would after this service's process ended (a milvus-lite folder is one process's)
        app.state.engine.images.close()
        return sorted(h["name"] for h in hits)

    assert serve() == sorted(service_env.dev[:3])
    (photos / service_env.dev[0]).unlink()
    shutil.copy(service_env.image_path(service_env.dev[3]), photos / service_env.dev[3])
    assert serve() == sorted(service_env.dev[1:4])
