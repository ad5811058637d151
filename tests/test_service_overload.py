"""Bounded work under overload: a full queue answers 503 with Retry-After at once, a request past
its deadline answers 504 (abandoned before it started when it was still waiting), both counted in
/metrics, and the work in flight never exceeds the slots.

The work is held in place by the test (it takes the locks the work needs), so which request
waits, runs or is refused follows from ordering, not from how fast the machine is.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

POLL = 0.01
POLL_LIMIT = 6000  # bounded waits: 60 s at most


def metric(text: str, name: str, **labels: str) -> float:
    """A sample's value in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == want:
            return float(m.group(3))
    return 0.0


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(POLL_LIMIT):
        if cond():
            return
        await asyncio.sleep(POLL)
    raise AssertionError("condition never met")


def run_app(app: FastAPI, scenario: Callable[[httpx.AsyncClient], Awaitable[object]]) -> object:
    async def go() -> object:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            return await scenario(c)
    return asyncio.run(go())


def annotate(c: httpx.AsyncClient, env: ServiceEnv) -> Awaitable[httpx.Response]:
    return c.post("/annotate", files={"file": ("x.jpg", env.jpeg(), "image/jpeg")})


def test_a_full_heavy_queue_is_refused_at_once(service_env: ServiceEnv, tmp_path: Path) -> None:
    settings, engine = service_env.writable(tmp_path, heavy_slots=1, heavy_queue=1)
    app = create_app(settings, engine=engine)
    gate = app.state.gates.heavy

    async def scenario(c: httpx.AsyncClient) -> tuple[list[httpx.Response], httpx.Response, str]:
        assert engine.sentences is not None
        with engine.sentences.rw.write():  # the running annotation blocks in its thread (at the index's read lock)
            first = asyncio.create_task(annotate(c, service_env))
            await until(lambda: gate.running == 1)
            second = asyncio.create_task(annotate(c, service_env))
            await until(lambda: gate.waiting == 1)
            third = await annotate(c, service_env)  # slots and queue taken: refused without waiting
            upload = await c.post("/images", files={"file": ("y.jpg", service_env.jpeg(), "image/jpeg")},
                                  headers={"X-API-Key": service_env.api_key})
            assert not first.done() and not second.done()
        done = list(await asyncio.gather(first, second))
        return [*done, upload], third, (await c.get("/metrics")).text

    served, refused, metrics = run_app(app, scenario)  # type: ignore[misc]
    assert [r.status_code for r in served[:2]] == [200, 200]
    for r in (refused, served[2]):
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        assert "busy" in r.json()["error"]["message"]
    assert metric(metrics, "fragsearch_refused_total", gate="heavy", reason="overloaded") == 2
    assert gate.running == 0 and gate.waiting == 0


def test_past_the_deadline_the_client_gets_504_and_waiting_work_never_starts(service_env: ServiceEnv,
                                                                            tmp_path: Path) -> None:
    settings, engine = service_env.writable(tmp_path, heavy_slots=1, heavy_queue=2, heavy_deadline=0.3)
    app = create_app(settings, engine=engine)
    gate = app.state.gates.heavy
    calls: list[str] = []
    real = engine.annotate

    def counted(data: bytes, k: int, offset: int = 0) -> object:
        calls.append("started")
        return real(data, k, offset)

    engine.annotate = counted  # type: ignore[method-assign]

    async def scenario(c: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response, str, int]:
        assert engine.sentences is not None
        with engine.sentences.rw.write():  # the running annotation blocks in its thread
            first = asyncio.create_task(annotate(c, service_env))
            await until(lambda: gate.running == 1)
            second = await annotate(c, service_env)  # waits in the queue past its deadline
            first_done = await first  # its work is stuck behind the held lock: answered at its deadline
            started_while_held = len(calls)
        await until(lambda: gate.running == 0)  # the abandoned running work finishes and frees its slot
        return first_done, second, (await c.get("/metrics")).text, started_while_held

    first, second, metrics, started = run_app(app, scenario)  # type: ignore[misc]
    assert first.status_code == 504 and second.status_code == 504
    assert "deadline" in first.json()["error"]["message"]
    assert "abandoned before it started" in second.json()["error"]["message"]
    assert started == 1, "the queued request's work never started"
    assert calls == ["started"]
    assert metric(metrics, "fragsearch_refused_total", gate="heavy", reason="deadline") == 2


def test_searches_beyond_the_limit_are_refused(service_env: ServiceEnv, tmp_path: Path) -> None:
    settings, engine = service_env.writable(tmp_path, search_slots=1, search_queue=1)
    app = create_app(settings, engine=engine)
    gate = app.state.gates.search
    sentence = service_env.captions[service_env.dev[0]][0]

    async def scenario(c: httpx.AsyncClient) -> tuple[list[httpx.Response], list[httpx.Response], str]:
        def search() -> Awaitable[httpx.Response]:
            return c.post("/search/images", json={"sentence": sentence, "k": 3})

        with engine.images.rw.write():  # searches block on the index's read lock in their threads
            running = asyncio.create_task(search())
            await until(lambda: gate.running == 1)
            queued = asyncio.create_task(search())
            await until(lambda: gate.waiting == 1)
            refused = [await search(), await c.post("/search/fragments", json={"phrase": "red circle"})]
            health = await c.get("/healthz")
            assert health.status_code == 200
        served = list(await asyncio.gather(running, queued))
        return served, refused, (await c.get("/metrics")).text

    served, refused, metrics = run_app(app, scenario)  # type: ignore[misc]
    assert [r.status_code for r in served] == [200, 200]
    assert [r.status_code for r in refused] == [503, 503]
    assert all(r.headers["retry-after"] == "1" for r in refused)
    assert metric(metrics, "fragsearch_refused_total", gate="search", reason="overloaded") == 2
    assert metric(metrics, "fragsearch_gate_running", gate="search") == 0


def test_engine_methods_are_unchanged_by_the_gate(service_env: ServiceEnv) -> None:
    """The gate only schedules: a search through the app gives the engine's own answer."""
    engine: Engine = service_env.engine
    app = create_app(service_env.settings, engine=engine)
    sentence = service_env.captions[service_env.dev[1]][0]

    async def scenario(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post("/search/images", json={"sentence": sentence, "k": 5})

    r = run_app(app, scenario)
    assert isinstance(r, httpx.Response) and r.status_code == 200
    assert [h["id"] for h in r.json()["results"]] == [h.image_id for h in engine.search_images(sentence, 5).hits]
