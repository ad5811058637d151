"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe): no port,
no extra package. Commands go to the child's fd 3, answers and events come from its fd 4, each a
JSON message ended by a NUL byte."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,1000")


class CdpError(RuntimeError):
    pass


class Browser:
    """One page of a headless Chromium; `evaluate` runs JavaScript in it (promises awaited)."""

    def __init__(self, chromium: Path, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="chromium-cdp-")
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()
        command = shlex.join([str(chromium), *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
                              "about:blank"])
        self.proc = subprocess.Popen(["bash", "-c", f"exec {command} 3<&{to_child} 4>&{from_child}"],
                                     pass_fds=(to_child, from_child), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""
        self._next_id = 0
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def call(self, method: str, params: dict[str, Any] | None = None, session: bool = False) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            for answer in self._messages(deadline):
                if answer.get("id") == self._next_id:
                    if "error" in answer:
                        raise CdpError(f"{method}: {answer['error']}")
                    return dict(answer.get("result", {}))

    def _messages(self, deadline: float) -> list[dict[str, Any]]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer from Chromium")
        ready, _, _ = select.select([self._read], [], [], left)
        if not ready:
            raise TimeoutError("no answer from Chromium")
        chunk = os.read(self._read, 1 << 20)
        if not chunk:
            raise CdpError("Chromium closed its pipe")
        self._buffer += chunk
        *done, self._buffer = self._buffer.split(b"\0")
        return [json.loads(m) for m in done if m]

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, session=True)
        if "exceptionDetails" in result:
            raise CdpError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", {"url": url}, session=True)
        self.wait_for("document.readyState === 'complete' && !!document.getElementById('results')")

    def wait_for(self, condition: str, timeout: float | None = None) -> None:
        """Poll a JavaScript condition until it holds (at most `timeout` seconds)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self.evaluate(f"Boolean({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"never true: {condition}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(CdpError, TimeoutError, OSError):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)
