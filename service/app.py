"""The app factory: FastAPI with the API routes, metrics, the web page and one JSON error model.

The model and indexes load once, in a worker thread at start-up (GET /readyz answers 503 until
then), and are shared read-only by all requests; CPU-heavy work runs in the threadpool.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from fragsearch.model.onnx import set_threads
from fragsearch.service import errors
from fragsearch.service.admission import Gate, Gates
from fragsearch.service.engine import Engine
from fragsearch.service.limits import BodyLimitMiddleware
from fragsearch.service.metrics import Metrics, MetricsMiddleware
from fragsearch.service.prepare import Apart, PreparationFailed, PreparationStopped, Progress
from fragsearch.service.routes import health, images, search
from fragsearch.service.version import __version__
from fragsearch.service.watch import FolderWatcher
from fragsearch.settings import API_KEY_HEADER, Settings

logger = logging.getLogger(__name__)
T = TypeVar("T")

STATIC = Path(__file__).resolve().parent / "static"
DESCRIPTION = """Cross-modal image/sentence retrieval with Deep Fragment Embeddings.

Images are ranked for a sentence (and sentences for an image) by the exact S_kl score; every result
carries its fragment alignment: each sentence fragment (a dependency triplet) with the image region
it matched, as a box in the image's own pixels, and its fragment score. Every error has the
`ErrorResponse` body."""


def settle_heap(settings: Settings) -> None:
    """Collect once, then freeze what is alive (gc.freeze): the model, the indexes and the parsers, some
    850,000 objects that live as long as the process. Left to the collector, each full collection walks
    them all (~0.4 s on a 2-core machine) while holding the GIL, so every request in flight, /healthz
    included, stalls; frozen, they are never walked again. Objects made later are collected as usual."""
    if not settings.freeze_heap:
        return
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info("froze %d long-lived objects in %.2fs", gc.get_freeze_count(), time.perf_counter() - t0)


def load_engine(settings: Settings) -> Engine:
    """Load (and optionally warm up) the engine; blocking."""
    if settings.threads:
        set_threads(settings.threads)
    engine = Engine.load(settings)
    if settings.warmup:
        engine.warm_up()
    settle_heap(settings)
    return engine


def prepare_and_load(app: FastAPI, settings: Settings, progress: Progress) -> Engine:
    """Prepare what is missing (service/prepare.py) in a child process, publishing a search-only engine as soon as
    the image index is ready, then attach the sentence index; blocking."""

    def images_ready() -> None:
        progress.enter("loading", "the model and the image index: searches are served from here on")
        app.state.engine = Engine.load(settings, with_sentences=False)

    app.state.preparation.run(settings, progress, on_images=images_ready)
    progress.enter("loading", "the sentence index")
    engine: Engine = app.state.engine
    engine.attach_sentences()
    if settings.warmup:
        engine.warm_up()
    settle_heap(settings)
    return engine


async def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a new daemon thread, awaited."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, failed: bool) -> None:
        if not fut.done():
            (fut.set_exception if failed else fut.set_result)(value)

    def body() -> None:
        try:
            out: Any = (fn(*args), False)
        except BaseException as e:  # handed to the awaiting task
            out = (e, True)
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the service stopped meanwhile
            loop.call_soon_threadsafe(settle, *out)

    threading.Thread(target=body, name=f"{fn.__name__}", daemon=True).start()
    return await fut


async def _load_in_background(app: FastAPI, settings: Settings, started: float, progress: Progress | None) -> None:
    """Load the engine in a worker thread (preparing first when `progress` is given); `started` is the
    perf_counter the ready time is measured from."""
    try:
        if progress is None:
            engine = await asyncio.to_thread(load_engine, settings)
        else:
            if settings.threads:
                set_threads(settings.threads)
            # a daemon thread: stopping the service does not wait for a preparation under way
            engine = await _in_daemon_thread(prepare_and_load, app, settings, progress)
    except PreparationStopped:
        logger.info("the preparation under way was stopped with the service")
        return
    except PreparationFailed as e:  # the child's error and traceback
        logger.error("could not prepare the model and indexes: %s\n%s", e, e.trace)
        app.state.load_error = str(e)
        return
    except Exception as e:  # reported by /readyz and the log; the process stays up for /healthz
        logger.exception("could not prepare or load the model and indexes")
        app.state.load_error = f"{type(e).__name__}: {e}"
        return
    app.state.engine = engine
    if progress is not None:
        progress.finish()
    start_watching(app, settings, engine)
    app.state.ready = True
    app.state.metrics.ready.set(1)
    logger.info("ready in %.1fs after start-up", time.perf_counter() - started)


def start_watching(app: FastAPI, settings: Settings, engine: Engine) -> None:
    """With a collection folder (and FRAGSEARCH_WATCH on): follow it while serving (service/watch.py)."""
    if settings.collection is None or not settings.watch or app.state.watcher is not None:
        return
    watcher = FolderWatcher(settings.collection, engine.resync, settings.watch_debounce_ms,
                            settings.watch_rescan, settings.watch_polling)
    app.state.watcher = watcher
    watcher.start()
    logger.info("watching %s for added, changed, moved and deleted photos", settings.collection)


def create_app(settings: Settings | None = None, engine: Engine | None = None,
               started: float | None = None, prepare: bool = False) -> FastAPI:
    """The service. With `engine` given it is used as is (ready at once); otherwise it is loaded
    from the settings' paths in the background after start-up, after preparing what is missing
    when `prepare` is set (GET /readyz reports how far that got). `started` (a time.perf_counter
    value, default: when the app starts) is what the logged ready time is measured from."""
    settings = settings or Settings()
    metrics = Metrics()
    progress = Progress() if prepare and engine is None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task: asyncio.Task[None] | None = None
        if app.state.engine is None:
            t0 = started if started is not None else time.perf_counter()
            task = asyncio.create_task(_load_in_background(app, settings, t0, progress))
        else:
            start_watching(app, settings, app.state.engine)
        yield
        if app.state.preparation is not None:  # a preparation under way ends with the service
            await asyncio.to_thread(app.state.preparation.stop)
        if task is not None and not task.done():
            task.cancel()
        if app.state.watcher is not None:
            await asyncio.to_thread(app.state.watcher.stop)
            app.state.watcher = None

    app = FastAPI(title="fragsearch", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.load_error = None
    app.state.progress = progress
    app.state.preparation = Apart() if progress is not None else None
    app.state.ready = engine is not None
    app.state.watcher = None
    metrics.watch_backlog.set_function(lambda: float(app.state.watcher.backlog()) if app.state.watcher else 0.0)
    if engine is not None:
        metrics.ready.set(1)
    app.state.gates = Gates(
        heavy=Gate("heavy", settings.heavy_slots, settings.heavy_queue, settings.heavy_deadline,
                   settings.retry_after, metrics),
        search=Gate("search", settings.search_slots, settings.search_queue, settings.search_deadline,
                    settings.retry_after, metrics))

    def size(attr: str) -> float:
        eng = app.state.engine
        if eng is None:
            return 0.0
        return float(len(eng.images) if attr == "images" else eng.sentence_count())

    metrics.track_index("images", lambda: size("images"))
    metrics.track_index("sentences", lambda: size("sentences"))

    def searches() -> dict[str, dict[str, int]]:
        eng = app.state.engine
        if eng is None:
            return {}
        indexes = {"images": eng.images, "sentences": eng.sentences}
        return {name: index.searches for name, index in indexes.items() if index is not None}

    metrics.track_searches(searches)

    errors.install(app)
    app.include_router(search.router)
    app.include_router(images.router)
    app.include_router(health.router)
    upload_limit = settings.max_upload_bytes  # the one body-size rule: each route's limit, while the body streams in
    app.add_middleware(BodyLimitMiddleware, limits={"/annotate": upload_limit, "/images": upload_limit,
                                                           "/search/similar": upload_limit},
                       default=settings.max_json_bytes, timeout=settings.body_timeout)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # it also counts refused bodies
    if settings.cors_origins:  # outermost: a browser's preflight is answered before any other check
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Content-Type", API_KEY_HEADER], max_age=600)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
