"""Malformed paths, bodies and headers sent over a real socket to a real uvicorn on loopback.

Each request of the table is written byte for byte (so that it can lie about its length, break
the chunked encoding or carry odd headers), its answer read from the socket, and the service
asked GET /healthz afterwards. What reaches the app answers a 4xx with the JSON error body; what
uvicorn's HTTP parser cannot read as HTTP at all (a non-numeric Content-Length, a broken chunk, no
Host header) never reaches the app and is answered 400 by uvicorn itself, in
plain text (which of the two answers a borderline request, e.g. a 30-digit Content-Length or a
body both chunked and with a Content-Length, is uvicorn's choice: the table allows either). No
request may produce a 5xx or stop the service answering.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fragsearch.service.app import create_app
from tests.uvicorn_thread import uvicorn_server

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

BODY_TIMEOUT = 1.0  # the server's body timeout in these tests (seconds)
READ_TIMEOUT = 30.0
APP, PARSER = "app", "parser"  # who answers: the app (JSON error body) or uvicorn's HTTP parser (plain)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Server:
    host: str
    port: int
    key: str

    def send(self, raw: bytes, half_close: bool = False) -> Answer | None:
        """Write raw bytes, read one HTTP answer (None when the server closed without answering)."""
        with socket.create_connection((self.host, self.port), timeout=READ_TIMEOUT) as s:
            s.sendall(raw)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            data = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not chunk:
                    break
                data += chunk
                answer = parse(data)
                if answer is not None:
                    return answer
        return parse(data)


def parse(data: bytes) -> Answer | None:
    """One complete HTTP/1.1 answer from the bytes read so far (None if incomplete)."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    if len(rest) < length:
        return None
    return Answer(status, headers, rest[:length])


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            length: int | None = None) -> bytes:
    """A request as bytes; `length` overrides the Content-Length (None: the true length, -1: none)."""
    hdrs = {"Host": "127.0.0.1", **(headers or {})}
    if length != -1 and (body or method in ("POST", "DELETE") or length is not None):
        hdrs["Content-Length"] = str(len(body) if length is None else length)
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    return head.encode("latin-1") + body


def multipart(fields: dict[str, tuple[str | None, bytes]], boundary: str = "xyzzy") -> tuple[bytes, str]:
    parts = b""
    for name, (filename, value) in fields.items():
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        parts += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    return parts + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.fixture(scope="module")
def server(service_env: ServiceEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("blackbox")
    settings, engine = service_env.writable(tmp, body_timeout=BODY_TIMEOUT)
    with uvicorn_server(create_app(settings, engine=engine)) as base:
        yield Server("127.0.0.1", int(base.rsplit(":", 1)[1]), service_env.api_key)


def test_the_test_server_reports_a_start_that_failed() -> None:
    """The one uvicorn-in-a-thread helper: a failed lifespan start is an error at once, not a wait."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    @asynccontextmanager
    async def broken(app: FastAPI) -> Iterator[None]:  # type: ignore[misc]
        raise OSError("the index folder is gone")
        yield

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="start-up failed"), uvicorn_server(FastAPI(lifespan=broken)):
        pass
    assert time.monotonic() - started < 20


DIGITS = "9" * 5000
JSON = {"Content-Type": "application/json"}


def cases(key: str, upload: bytes) -> list[tuple[str, bytes, set[int], str, bool]]:
    """(name, raw request, allowed statuses, who answers, half-close after sending)."""
    auth = {"X-API-Key": key}
    annotate_big_k, ct = multipart({"file": ("a.jpg", upload), "k": (None, DIGITS.encode())})
    no_boundary_body, _ = multipart({"file": ("a.jpg", upload)})
    search = json.dumps({"sentence": "a red circle", "k": 3}).encode()
    deep = b"[" * 20000 + b"]" * 20000
    bad_upload, bad_ct = multipart({"file": ("../../x.jpg", b"not an image")})
    out: list[tuple[str, bytes, set[int], str, bool]] = [
        # ids of any length or form
        ("get 5000-digit id", request("GET", f"/images/{DIGITS}"), {404}, APP, False),
        ("delete 5000-digit id", request("DELETE", f"/images/{DIGITS}", headers=auth), {404}, APP, False),
        ("get id 2^63", request("GET", f"/images/{2**63}"), {404}, APP, False),
        ("delete id 2^63", request("DELETE", f"/images/{2**63}", headers=auth), {404}, APP, False),
        ("get id -1", request("GET", "/images/-1"), {404}, APP, False),
        ("get id 1e3", request("GET", "/images/1e3"), {404}, APP, False),
        ("get id 0x10", request("GET", "/images/0x10"), {404}, APP, False),
        ("get id +1", request("GET", "/images/+1"), {404}, APP, False),
        ("get id 007", request("GET", "/images/007"), {404}, APP, False),
        ("get id with NUL", request("GET", "/images/1%00"), {404}, APP, False),
        ("get id emoji", request("GET", "/images/%F0%9F%90%B6"), {404}, APP, False),
        ("get id bad utf-8", request("GET", "/images/%ff%fe"), {404}, APP, False),
        ("get encoded ../", request("GET", "/images/..%2F..%2Fetc%2Fpasswd"), {404}, APP, False),
        ("get unknown id", request("GET", "/images/123456789"), {404}, APP, False),
        ("delete unknown id", request("DELETE", "/images/123456789", headers=auth), {404}, APP, False),
        ("delete without key", request("DELETE", "/images/0"), {401}, APP, False),
        # odd headers
        ("api key of odd bytes", request("DELETE", "/images/0", headers={"X-API-Key": "\xff\xfe key"}), {403},
         APP, False),
        ("api key of 8 KB", request("DELETE", "/images/0", headers={"X-API-Key": "k" * 8000}), {403}, APP, False),
        ("unknown method", request("BREW", "/healthz"), {405}, APP, False),
        ("wrong method on search", request("GET", "/search/images"), {405}, APP, False),
        ("json as text/plain", request("POST", "/search/images", search, {"Content-Type": "text/plain"}), {422},
         APP, False),
        ("multipart without boundary", request("POST", "/annotate", no_boundary_body,
                                               {"Content-Type": "multipart/form-data"}), {422}, APP, False),
        ("multipart to a json route", request("POST", "/search/images", no_boundary_body, {"Content-Type": ct}),
         {422}, APP, False),
        ("json to an upload route", request("POST", "/annotate", search, JSON), {422}, APP, False),
        ("charset nonsense", request("POST", "/search/images", search,
                                     {"Content-Type": "application/json; charset=klingon"}), {422, 200}, APP, False),
        ("header of 12 KB", request("GET", "/healthz", headers={"X-Junk": "a" * 12000}), {200}, APP, False),
        ("header of 200 KB", request("GET", "/healthz", headers={"X-Junk": "a" * 200_000}), {200, 400, 431},
         PARSER, False),
        ("non-numeric content-length", request("POST", "/search/images", search, JSON, length=-1)
         .replace(b"\r\n\r\n", b"\r\nContent-Length: abc\r\n\r\n", 1), {400}, PARSER, False),
        ("content-length of 30 digits", request("POST", "/search/images", search, JSON, length=10**29), {400, 413},
         PARSER, False),
        ("content-length over the limit", request("POST", "/search/images", search, JSON, length=10**9), {413},
         APP, False),
        ("content-length and chunked", request("POST", "/search/images", search,
                                               {**JSON, "Transfer-Encoding": "chunked"}), {400, 408}, PARSER, False),
        ("broken chunk size", request("POST", "/search/images", b"zz\r\nabc\r\n0\r\n\r\n",
                                      {**JSON, "Transfer-Encoding": "chunked"}, length=-1), {400}, PARSER, False),
        ("no host header", b"GET /healthz HTTP/1.1\r\n\r\n", {400}, PARSER, False),
        # bodies that lie
        ("body shorter than its length", request("POST", "/search/images", search, JSON, length=len(search) + 50),
         {408}, APP, False),
        ("upload shorter than its length", request("POST", "/annotate", annotate_big_k, {"Content-Type": ct},
                                                   length=len(annotate_big_k) + 1000), {408}, APP, False),
        ("body longer than its length", request("POST", "/search/images", search, JSON, length=5), {422}, APP,
         False),
        ("empty body", request("POST", "/search/images", b"", JSON), {422}, APP, False),
        ("json of deep nesting", request("POST", "/search/images", deep, JSON), {422}, APP, False),
        ("json k of 5000 digits", request("POST", "/search/images",
                                          b'{"sentence": "a red circle", "k": ' + DIGITS.encode() + b"}", JSON),
         {422}, APP, False),
        ("json of bad utf-8", request("POST", "/search/images", b'{"sentence": "\xff\xfe"}', JSON), {422}, APP,
         False),
        ("form k of 5000 digits", request("POST", "/annotate", annotate_big_k, {"Content-Type": ct}), {422}, APP,
         False),
        ("upload named ../../x", request("POST", "/images", bad_upload, {**auth, "Content-Type": bad_ct}), {415},
         APP, False),
        ("body cut off by the client", request("POST", "/search/images", search[:10], JSON, length=len(search)),
         {400, 408, 0}, APP, True),
    ]
    return out


def test_malformed_requests_get_4xx_and_the_service_stays_up(server: Server, service_env: ServiceEnv) -> None:
    failures = []
    for name, raw, allowed, who, half_close in cases(server.key, service_env.jpeg()):
        answer = server.send(raw, half_close=half_close)
        status = answer.status if answer is not None else 0
        if status not in allowed:
            failures.append(f"{name}: {status} {answer.body[:200] if answer else b''!r}, expected {allowed}")
        elif answer is not None and who == APP and status >= 400:
            try:
                error = json.loads(answer.body)["error"]
                assert error["code"] and error["message"]
            except (ValueError, KeyError, TypeError, AssertionError):
                failures.append(f"{name}: {status} without the JSON error body: {answer.body[:200]!r}")
        health = server.send(request("GET", "/healthz"))
        if health is None or health.status != 200:
            failures.append(f"after {name}: /healthz answered {health.status if health else 'nothing'}")
    metrics = server.send(request("GET", "/metrics"))
    assert metrics is not None and metrics.status == 200
    server_errors = [ln for ln in metrics.body.decode().splitlines()
                     if ln.startswith("fragsearch_requests_total") and 'status="5' in ln]
    assert not failures, "\n".join(failures)
    assert not server_errors, server_errors
