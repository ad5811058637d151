"""Dependencies shared by the routes: the loaded engine and the write key check."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader

from service.admission import Gates
from service.engine import Engine
from service.errors import ApiError
from service.settings import API_KEY_HEADER, Settings

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
WriteKey = Depends(require_key)
