"""Concurrent requests: searches run while images are added and removed; results stay consistent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from service.app import create_app
from service.engine import Engine

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

SEARCHES = 24


async def _scenario(engine: Engine, env: ServiceEnv) -> tuple[list[httpx.Response], list[httpx.Response], set[int]]:
    app = create_app(engine.settings, engine=engine)
    transport = httpx.ASGITransport(app=app)
    original = {h.image_id for h in engine.images.search("a red circle", 1000)}
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
        sentence = env.captions[env.dev[1]][0]
        expected = (await c.post("/search/images", json={"sentence": sentence, "k": 5})).json()["results"]

        async def search(i: int) -> httpx.Response:
            await asyncio.sleep(0.005 * i)
            return await c.post("/search/images", json={"sentence": sentence, "k": 5})

        async def write() -> list[httpx.Response]:
            key = {"X-API-Key": env.api_key}
            added = await c.post("/images", files={"file": ("new.jpg", env.jpeg(env.dev[2]), "image/jpeg")},
                                 headers=key)
            bad = await c.post("/images", files={"file": ("bad.jpg", b"broken", "image/jpeg")}, headers=key)
            gone = await c.delete(f"/images/{added.json()['id']}", headers=key)
            return [added, bad, gone]

        results = await asyncio.gather(write(), *(search(i) for i in range(SEARCHES)))
        writes = results[0]
        searches = list(results[1:])
        searches.append(await c.post("/search/images", json={"sentence": sentence, "k": 5}))
    for r in searches:
        assert r.status_code == 200, r.text
    # an unchanged sentence and an index that ends as it began: the last answer equals the first
    assert searches[-1].json()["results"] == expected
    return writes, searches, original


def test_searches_stay_consistent_during_writes(service_env: ServiceEnv, tmp_path: Path) -> None:
    settings, engine = service_env.writable(tmp_path)
    writes, searches, original = asyncio.run(_scenario(engine, service_env))
    added, bad, gone = writes
    assert added.status_code == 201 and bad.status_code == 415 and gone.status_code == 204
    new_id = added.json()["id"]
    for r in searches:
        ids = [h["id"] for h in r.json()["results"]]
        assert set(ids) <= original | {new_id}, "only images that were in the index at some moment"
        assert len(ids) == len(set(ids)) == 5
        scores = [h["score"] for h in r.json()["results"]]
        assert scores == sorted(scores, reverse=True)
    assert {h.image_id for h in engine.images.search("a red circle", 1000)} == original
    assert not any(settings.uploads_dir.iterdir()), "the deleted upload's file is gone too"


def test_the_event_loop_stays_responsive_during_heavy_requests(service_env: ServiceEnv) -> None:
    """/healthz answers while annotations (CPU-heavy, in the threadpool) are running."""
    app = create_app(service_env.settings, engine=service_env.engine)

    async def run() -> tuple[float, list[int]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            upload = service_env.jpeg()
            heavy = [asyncio.create_task(c.post("/annotate", files={"file": ("x.jpg", upload, "image/jpeg")}))
                     for _ in range(3)]
            await asyncio.sleep(0.05)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            health = await c.get("/healthz")
            took = loop.time() - t0
            done = await asyncio.gather(*heavy)
            assert health.status_code == 200
            return took, [r.status_code for r in done]

    took, statuses = asyncio.run(run())
    assert statuses == [200, 200, 200]
    assert took < 0.5, f"/healthz waited {took:.2f}s behind the annotations"
