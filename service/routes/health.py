"""GET /healthz, GET /readyz, GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.deps import EngineDep
from service.errors import responses
from service.metrics import Metrics
from service.schemas import Health, Ready


def build_router() -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """The process is alive (it may still be loading)."""
        return Health(status="ok")

    @router.get("/readyz", response_model=Ready, responses=responses(503))
    async def readyz(engine: EngineDep) -> Ready:
        """The model and indexes are loaded: 503 until then."""
        return Ready(status="ready", images=len(engine.images), sentences=engine.sentence_count(),
                     load_seconds=round(engine.load_seconds, 3))

    @router.get("/metrics", response_class=Response,
                responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def metrics(request: Request) -> Response:
        """Request counts and latencies per route, index sizes, process memory (Prometheus)."""
        m = request.app.state.metrics
        assert isinstance(m, Metrics)
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    return router
