"""Prometheus metrics: request counts and latencies per route, index sizes and search paths, process memory,
collections.

Each app has its own registry (several apps may live in one process, e.g. in tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
UNMATCHED = "<unmatched>"


class Metrics:
    """The registry and the instruments the middleware and /metrics use."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)  # collections per generation: full ones pause every request
        self.requests = Counter("fragsearch_requests", "HTTP requests answered", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("fragsearch_request_seconds", "HTTP request latency", ["method", "route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.index_size = Gauge("fragsearch_index_size", "items in an index", ["index"], registry=self.registry)
        self.ready = Gauge("fragsearch_ready", "1 once the model and indexes are loaded", registry=self.registry)
        self.refused = Counter("fragsearch_refused", "requests refused by an admission gate (reason: overloaded = "
                               "503 at once, deadline = 504)", ["gate", "reason"], registry=self.registry)
        self.gate_running = Gauge("fragsearch_gate_running", "requests of a gate whose work is running",
                                  ["gate"], registry=self.registry)
        self.gate_waiting = Gauge("fragsearch_gate_waiting", "requests of a gate waiting for a slot", ["gate"],
                                  registry=self.registry)
        self.watch_backlog = Gauge("fragsearch_watch_backlog", "files of the watched collection folder changed "
                                   "and not yet applied to the index", registry=self.registry)

    def track_index(self, name: str, size: Callable[[], float]) -> None:
        self.index_size.labels(index=name).set_function(size)

    def track_searches(self, searches: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        """`searches()`: index name -> path -> searches answered (index.ranker.Ranker.searches)."""
        self.registry.register(SearchPaths(searches))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SearchPaths(Collector):
    """fragsearch_index_searches_total{index, path}: the searches each index answered by the exact scan
    of every item ("scan": collections under `exact_below` fragments) or by candidate recall + the
    exact re-rank ("candidates"), read from the indexes when /metrics is scraped."""

    def __init__(self, searches: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.searches = searches

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("fragsearch_index_searches", "searches an index answered, by path: scan (the "
                                     "exact score over every item) or candidates (recall, then the exact re-rank)",
                                     labels=["index", "path"])
        for index, paths in self.searches().items():
            for path, count in paths.items():
                family.add_metric([index, path], count)
        yield family


class MetricsMiddleware:
    """Counts and times every HTTP request, labelled by its route template (not the raw path)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path_format", None) or getattr(route, "path", None) or UNMATCHED
            method = str(scope.get("method", ""))
            self.metrics.requests.labels(method=method, route=path, status=str(status)).inc()
            self.metrics.latency.labels(method=method, route=path).observe(time.perf_counter() - start)
