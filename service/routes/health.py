"""GET /healthz, GET /readyz, GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from fragsearch.model.calibration import DEFAULT_CUTOFF
from fragsearch.service.engine import Engine
from fragsearch.service.errors import responses
from fragsearch.service.metrics import Metrics
from fragsearch.service.prepare import Progress
from fragsearch.service.schemas import ErrorBody, Health, NotReady, PrepareProgress, Ready, WatchOut

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive (it may still be loading)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, responses=responses(503))
async def readyz(request: Request) -> Ready | JSONResponse:
    """The model and both indexes are loaded: 503 until then. The 503 body is the error body plus
    `status` (preparing / loading / failed), `progress` (stage, step, items done / total of the
    step under way, estimated seconds left, stages done and left) and `serving` (routes that
    already answer): the `NotReady` schema."""
    state = request.app.state
    engine = state.engine
    if state.ready and isinstance(engine, Engine):
        return Ready(status="ready", images=len(engine.images), sentences=engine.sentence_count(),
                     load_seconds=round(engine.load_seconds, 3), relevance=engine.bundle.relevance is not None,
                     default_min_relevance=DEFAULT_CUTOFF,
                     watch=None if state.watcher is None else WatchOut(**state.watcher.snapshot()))
    error = state.load_error
    progress = state.progress
    snap = progress.snapshot() if isinstance(progress, Progress) else None
    if error:
        message = f"the model and indexes failed to prepare or load: {error}"
    elif snap is not None:
        message = f"preparing: {snap['stage']}" + (f" ({snap['detail']})" if snap["detail"] else "")
    else:
        message = "the model and index are loading"
    serving = ["/search/images", "/search/fragments", "/images/{id}"] if isinstance(engine, Engine) else []
    body = NotReady(status="failed" if error else ("preparing" if snap is not None else "loading"),
                    error=ErrorBody(code="not_ready", message=message),
                    progress=None if snap is None else PrepareProgress(**snap), serving=serving)
    return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": "5"})


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    """Request counts and latencies per route, index sizes, process memory (Prometheus)."""
    m = request.app.state.metrics
    assert isinstance(m, Metrics)
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
