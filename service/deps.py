"""Dependencies shared by the routes: the loaded engine, the write key check, and the request rules
that depend on the settings (`Bounds`; the shape rules are the schemas', service/schemas.py)."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader

from fragsearch.service.admission import Gates
from fragsearch.service.engine import Engine
from fragsearch.service.errors import ApiError
from fragsearch.settings import API_KEY_HEADER, Settings

api_key_header = APIKeyHeader(name=API_KEY_HEADER, auto_error=False,
                              description="required by POST /images and DELETE /images/{id}")


def get_settings(request: Request) -> Settings:
    settings = request.app.state.settings
    assert isinstance(settings, Settings)
    return settings


def get_engine(request: Request) -> Engine:
    """The loaded engine, or 503 while the model and indexes are still loading (or failed to)."""
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        reason = getattr(request.app.state, "load_error", None)
        message = f"the model and index failed to load: {reason}" if reason else "the model and index are loading"
        raise ApiError(503, "not_ready", message, headers={"Retry-After": "5"})
    assert isinstance(engine, Engine)
    return engine


class Bounds:
    """The settings-dependent request rules, each checked here only: k at most `k_max` (422 `bad_k`),
    offset + k at most `max_rank` (422 `bad_offset`), a text at most `max_sentence_chars` long (422
    `sentence_too_long`). k >= 1, offset >= 0 and a text that is not blank are the schemas' rules."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def page(self, k: int, offset: int) -> tuple[int, int]:
        """(k, offset) of a ranked page, within the limits."""
        s = self.settings
        if k > s.k_max:
            raise ApiError(422, "bad_k", f"k must be between 1 and {s.k_max}, got {k}")
        if offset + k > s.max_rank:
            raise ApiError(422, "bad_offset", f"offset + k must be at most {s.max_rank} (the deepest rank served), "
                           f"got {offset} + {k}")
        return k, offset

    def text(self, text: str, what: str) -> str:
        """A sentence or phrase (stripped and not blank already), within the length limit."""
        limit = self.settings.max_sentence_chars
        if len(text) > limit:
            raise ApiError(422, "sentence_too_long", f"the {what} has {len(text)} characters; the limit is {limit}")
        return text


def get_bounds(request: Request) -> Bounds:
    return Bounds(get_settings(request))


def get_gates(request: Request) -> Gates:
    gates = request.app.state.gates
    assert isinstance(gates, Gates)
    return gates


def require_key(request: Request, key: Annotated[str | None, Security(api_key_header)] = None) -> None:
    """Writes need the configured key: 401 without a key, 403 with a wrong one (or none configured)."""
    settings = get_settings(request)
    if settings.auth_disabled:
        return
    if not key:
        raise ApiError(401, "unauthorized", f"this write needs an API key in the {API_KEY_HEADER} header",
                       headers={"WWW-Authenticate": API_KEY_HEADER})
    if settings.api_key is None:
        raise ApiError(403, "forbidden", "writes are disabled: the service has no API key configured")
    if not secrets.compare_digest(key.encode(), settings.api_key.get_secret_value().encode()):
        raise ApiError(403, "forbidden", "wrong API key")


SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[Engine, Depends(get_engine)]
GatesDep = Annotated[Gates, Depends(get_gates)]
BoundsDep = Annotated[Bounds, Depends(get_bounds)]
WriteKey = Depends(require_key)
