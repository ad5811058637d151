"""Bounded work under overload: admission gates with a queue limit and a per-request deadline.

A gate has `slots` (requests whose work runs at once, each in a threadpool thread) and `queue`
(requests waiting for a slot). A request that finds all slots and the whole queue taken is refused
at once with 503 and `Retry-After`; one that waits past its deadline is answered 504 and its work
never starts; one whose work is still running at its deadline is answered 504 too, and the work
finishes in its thread (a thread cannot be stopped) while still holding its slot, so the work in
flight never exceeds `slots` however many clients give up.

Gates live on the event loop: their counters are touched only from coroutines and from done
callbacks of tasks, which run on the loop, so they need no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from fragsearch.service.errors import ApiError
from fragsearch.service.metrics import Metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Gate:
    """At most `slots` requests of a kind working and `queue` waiting; `deadline` seconds each."""

    def __init__(self, name: str, slots: int, queue: int, deadline: float, retry_after: float,
                 metrics: Metrics) -> None:
        if slots < 1 or queue < 0 or deadline <= 0:
            raise ValueError("a gate needs slots >= 1, queue >= 0 and a positive deadline")
        self.name = name
        self.slots = slots
        self.queue = queue
        self.deadline = deadline
        self.retry_after = retry_after
        self.metrics = metrics
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        metrics.gate_running.labels(gate=name).set_function(lambda: float(self.running))
        metrics.gate_waiting.labels(gate=name).set_function(lambda: float(len(self._waiters)))

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _refuse(self, reason: str, status: int, message: str) -> ApiError:
        self.metrics.refused.labels(gate=self.name, reason=reason).inc()
        return ApiError(status, reason, message, headers={"Retry-After": str(math.ceil(self.retry_after))})

    def _release(self) -> None:
        """A slot is free: hand it to the first waiter still waiting, or give it back."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: `running` stays the same
                return
        self.running -= 1

    def _finished(self, task: asyncio.Future[Any]) -> None:
        self._release()
        if not task.cancelled() and task.exception() is not None:  # retrieved: a late failure is only logged
            logger.debug("%s work failed after its request was answered: %r", self.name, task.exception())

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the threadpool once a slot is free; 503 if the queue is full, 504 past the deadline."""
        t0 = time.monotonic()
        if self.running >= self.slots:
            if len(self._waiters) >= self.queue:
                raise self._refuse("overloaded", 503, f"the service is busy ({self.name}: {self.running} running, "
                                   f"{len(self._waiters)} waiting); retry after {math.ceil(self.retry_after)} s")
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                done, _ = await asyncio.wait({waiter}, timeout=self.deadline)
            except asyncio.CancelledError:  # the client went away while waiting
                self._abandon(waiter)
                raise
            if not done:
                self._abandon(waiter)
                raise self._refuse("deadline", 504, f"the {self.name} request waited {self.deadline:g} s for a "
                                   "free slot and was abandoned before it started; retry later")
        else:
            self.running += 1
        task = asyncio.ensure_future(run_in_threadpool(fn, *args))
        task.add_done_callback(self._finished)
        remaining = self.deadline - (time.monotonic() - t0)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=max(remaining, 0.0))
        except TimeoutError:
            raise self._refuse("deadline", 504, f"the {self.name} request did not finish within its "
                               f"{self.deadline:g} s deadline") from None

    def _abandon(self, waiter: asyncio.Future[None]) -> None:
        """A waiter gives up; if a slot was handed to it in the meantime, pass the slot on."""
        if waiter.done() and not waiter.cancelled():
            self._release()
            return
        waiter.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)


class Gates:
    """The service's gates: `heavy` (annotate and uploads: image extraction) and `search`."""

    def __init__(self, heavy: Gate, search: Gate) -> None:
        self.heavy = heavy
        self.search = search
