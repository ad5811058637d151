"""Concurrent requests: searches run while images are added and removed; results stay consistent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

SEARCHES = 24


async def _scenario(engine: Engine, env: ServiceEnv) -> tuple[list[httpx.Response], list[httpx.Response], set[int]]:
    app = create_app(engine.settings, engine=engine)
    transport = httpx.ASGITransport(app=app)
    original = {h.image_id for h in engine.images.search("a red circle", 1000).hits}
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
    # every search is admitted (the admission limits are tested in test_service_overload.py)
    settings, engine = service_env.writable(tmp_path, search_queue=SEARCHES + 1)
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
    assert {h.image_id for h in engine.images.search("a red circle", 1000).hits} == original
    assert not any(settings.uploads.iterdir()), "the deleted upload's file is gone too"


def test_the_event_loop_stays_responsive_during_heavy_requests(service_env: ServiceEnv) -> None:
    """/healthz answers while annotations are in flight in the threadpool.

    Proved by ordering, not by timing: the test holds the sentence index's write lock, so the
    annotations stay in flight (blocked in their worker threads) until it lets go. /healthz must be
    answered before that; had an annotation run on the event loop, the loop itself would block
    and /healthz would never come back (the wait below is bounded).
    """
    engine = service_env.engine
    app = create_app(service_env.settings, engine=engine)
    slots = service_env.settings.heavy_slots

    async def run() -> tuple[int, list[bool], list[int]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            upload = service_env.jpeg()
            assert engine.sentences is not None
            with engine.sentences.rw.write():
                heavy = [asyncio.create_task(c.post("/annotate", files={"file": ("x.jpg", upload, "image/jpeg")}))
                         for _ in range(slots)]
                gates = app.state.gates
                for _ in range(6000):  # until every annotation is in a worker thread
                    if gates.heavy.running == slots:
                        break
                    await asyncio.sleep(0.01)
                assert gates.heavy.running == slots, "the annotations never reached their threads"
                health = await asyncio.wait_for(c.get("/healthz"), timeout=60)
                in_flight = [not t.done() for t in heavy]
            done = await asyncio.gather(*heavy)
            return health.status_code, in_flight, [r.status_code for r in done]

    health, in_flight, statuses = asyncio.run(run())
    assert health == 200
    assert all(in_flight), "/healthz was answered while every annotation was still in flight"
    assert statuses == [200] * slots
