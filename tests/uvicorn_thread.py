"""One real uvicorn serving an app in a thread, for the tests that need a socket (the browser, the black box)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


@contextlib.contextmanager
def uvicorn_server(app: FastAPI, start_timeout: float = 60.0) -> Iterator[str]:
    """The app served by a real uvicorn on 127.0.0.1 and a free port, in a daemon thread, with its
    lifespan; yields the base URL ("http://127.0.0.1:PORT") and stops the server on exit. A server whose
    start fails (its lifespan raised, the thread ended) or takes longer than `start_timeout` is an error."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as e:  # reported to the caller below
            failure.append(e)

    thread = threading.Thread(target=run, daemon=True, name="uvicorn-test-server")
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the test server did not start (its start-up failed: {failure[:1]!r})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test server did not start in {start_timeout:.0f} s")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
