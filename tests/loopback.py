"""A real uvicorn serving an app on 127.0.0.1 and a free port, in a daemon thread (the browser tests
and the README's curl examples talk to it over a socket)."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI


class ServerThread:
    """`with ServerThread(app) as base:` serves `app` at `base` (http://127.0.0.1:<port>) until the block ends."""

    def __init__(self, app: FastAPI) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
