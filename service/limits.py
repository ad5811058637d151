"""Request body limits enforced while the body streams in: an oversized upload is refused with
413 as soon as its declared length, or the bytes received so far, pass the limit (the rest is
never read)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_response

BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")
MULTIPART_OVERHEAD = 64 * 1024  # boundaries, part headers and small fields around an uploaded file


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the body passes its limit (FastAPI re-raises HTTPExceptions
    met while reading a body, so this reaches the JSON error handler as a 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"request body larger than {limit} bytes")
        self.limit = limit


class BodyLimitMiddleware:
    """Per-path body limits (`limits`: path -> bytes), `default` for every other path."""

    def __init__(self, app: ASGIApp, limits: Mapping[str, int], default: int) -> None:
        self.app = app
        self.limits = dict(limits)
        self.default = default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(str(scope.get("path", "")), self.default)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(limit, scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(limit, scope, receive, send)

    @staticmethod
    async def _refuse(limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, "too_large", f"request body larger than {limit} bytes",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)
