"""One JSON error shape for every failure, and the exception handlers that produce it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from fragsearch.service.schemas import EMPTY_TEXT, ErrorResponse

logger = logging.getLogger(__name__)

STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "body_timeout",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    503: "not_ready",
    504: "deadline",
    507: "insufficient_storage",
}


class ApiError(Exception):
    """An answer other than success: HTTP status, a short code and a message."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def error_response(status: int, code: str, message: str, details: list[dict[str, Any]] | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "details": details}}
    return JSONResponse(jsonable_encoder(body), status_code=status, headers=headers)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries, all with the ErrorResponse model."""
    descriptions = {
        401: "no API key", 403: "wrong API key, or writes disabled", 404: "unknown id",
        409: "no sentence collection to rank (a photo collection served without captions)",
        413: "body or image too large", 415: "not an image", 422: "invalid input (says why)",
        503: "model or index not loaded yet, or the service is busy (see Retry-After)",
        504: "the request did not finish within its deadline", 507: "no space left to save the index",
    }
    return {s: {"model": ErrorResponse, "description": descriptions.get(s, "error")} for s in statuses}


# validation errors with a code of their own, by (error type, field); None: any field. Others: invalid_request
VALIDATION_CODES = {(EMPTY_TEXT, None): "empty_sentence", ("missing", "sentence"): "empty_sentence"}


def _code(err: dict[str, Any]) -> str | None:
    loc = tuple(err.get("loc", ()))
    kind = str(err.get("type", ""))
    return VALIDATION_CODES.get((kind, None)) or VALIDATION_CODES.get((kind, str(loc[-1]) if loc else ""))


def _field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def _message(err: dict[str, Any]) -> str:
    loc = tuple(err.get("loc", ()))
    msg = str(err.get("msg", "invalid"))
    if err.get("type") == "missing" and loc and loc[-1] == "sentence":
        return "sentence: the sentence is empty (missing)"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{_field(loc)}: {msg}"


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if errors and all(tuple(e.get("loc", ()))[:1] == ("path",) for e in errors):
        # a path that does not name a resource (e.g. /images/abc or an encoded ../) is simply not found
        return error_response(404, "not_found", "no such resource")
    details = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
               for e in errors]
    code = next((c for c in map(_code, errors) if c is not None), "invalid_request")
    return error_response(422, code, "; ".join(_message(e) for e in errors) or "invalid request", details)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, headers=exc.headers)


async def _http_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    message = str(exc.detail) if exc.detail else "error"
    if status == 400:  # an unparseable body (not UTF-8 JSON, broken multipart) is invalid input like any other
        return error_response(422, "invalid_body", f"the request body cannot be parsed: {message}")
    headers = dict(exc.headers) if exc.headers else None
    return error_response(status, STATUS_CODES.get(status, "error"), message, headers=headers)


async def _disconnect_handler(request: Request, exc: Exception) -> JSONResponse:
    """The client closed the connection before its body arrived: nobody reads this answer."""
    logger.info("client went away during the body of %s %s", request.method, request.url.path)
    return error_response(400, "client_disconnected", "the client closed the connection before the body arrived")


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(500, "internal_error", "internal error")


def install(app: FastAPI) -> None:
    """Route every error through ErrorResponse."""
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(ApiError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(ClientDisconnect, _disconnect_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
