"""Request body limits enforced while the body streams in, the service's one body-size rule (an
upload's limit is `max_upload_bytes` for its whole body, a JSON body's `max_json_bytes`): an oversized
body is refused with 413 `too_large` as soon as its declared length, or the bytes received so far,
pass the limit (the rest is never read); a body that stops arriving (e.g. shorter than its
Content-Length) is refused with 408 once no part of it has come for `timeout` seconds."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fragsearch.service.errors import error_response

BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")


class BodyRefused(HTTPException):
    """Raised from `receive` when the body breaks a limit (FastAPI re-raises HTTPExceptions met while
    reading a body; the middleware answers with the JSON error body)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status_code=status, detail=message)
        self.code = code
        self.message = message


def body_too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, "too_large", f"request body larger than {limit} bytes")


def body_too_slow(timeout: float) -> BodyRefused:
    return BodyRefused(408, "body_timeout", f"the request body stopped arriving: nothing for {timeout:g} s "
                       "(is it shorter than its Content-Length?)")


class BodyLimitMiddleware:
    """Per-path body limits (`limits`: path -> bytes), `default` for every other path; `timeout`
    seconds at most between two parts of a body."""

    def __init__(self, app: ASGIApp, limits: Mapping[str, int], default: int, timeout: float) -> None:
        self.app = app
        self.limits = dict(limits)
        self.default = default
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(str(scope.get("path", "")), self.default)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() \
                and (len(declared.lstrip("0")) > len(str(limit)) or int(declared) > limit):
            await self._refuse(body_too_large(limit), scope, receive, send)
            return
        received = 0
        started = False
        complete = False

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete:  # after the body, receive() only waits for a disconnect: no time limit
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=self.timeout)
            except TimeoutError:
                raise body_too_slow(self.timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise body_too_large(limit)
                complete = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyRefused as refused:
            if started:
                raise
            await self._refuse(refused, scope, receive, send)

    @staticmethod
    async def _refuse(refused: BodyRefused, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(refused.status_code, refused.code, refused.message, headers={"Connection": "close"})
        await response(scope, receive, send)
