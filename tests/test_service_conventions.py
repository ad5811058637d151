"""Service conventions: CORS (off unless origins are set), JSON log lines, --version, the version."""

from __future__ import annotations

import json
import logging
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from fastapi.testclient import TestClient

from fragsearch.commands.serve import main
from fragsearch.service.app import create_app
from fragsearch.service.logs import JsonFormatter
from fragsearch.service.version import __version__

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

ORIGIN = "https://photos.example.org"


def preflight(c: TestClient, origin: str) -> dict[str, str]:
    r = c.options("/search/images", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                             "Access-Control-Request-Headers": "content-type"})
    return {k.lower(): v for k, v in r.headers.items()}


def test_cors_is_off_by_default(client: TestClient) -> None:
    assert "access-control-allow-origin" not in preflight(client, ORIGIN)
    r = client.get("/healthz", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def test_cors_allows_only_the_origins_set(service_env: ServiceEnv) -> None:
    settings = service_env.settings.model_copy(update={"cors_origins": [ORIGIN]})
    with TestClient(create_app(settings, engine=service_env.engine)) as c:
        allowed = preflight(c, ORIGIN)
        assert allowed["access-control-allow-origin"] == ORIGIN
        assert "POST" in allowed["access-control-allow-methods"]
        assert "access-control-allow-origin" not in preflight(c, "https://elsewhere.example.org")
        r = c.post("/search/images", json={"sentence": "a red circle", "k": 1}, headers={"Origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_json_log_lines() -> None:
    fmt = JsonFormatter()
    record = logging.LogRecord("service", logging.WARNING, __file__, 1, "ready in %.1fs", (2.5,), None)
    line = json.loads(fmt.format(record))
    assert line["level"] == "WARNING" and line["logger"] == "service" and line["message"] == "ready in 2.5s"
    assert line["time"].endswith("+00:00")
    try:
        raise ValueError("bad thing")
    except ValueError:
        failed = logging.LogRecord("service", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    out = fmt.format(failed)
    assert "\n" not in out and "ValueError: bad thing" in json.loads(out)["exception"]


def test_version_flag_and_openapi_agree_with_the_project(client: TestClient,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["dynamic"] == ["version"]  # read from service/version.py at build time
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fragsearch.service.version.__version__"}
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"fragsearch {__version__}"
    assert client.get("/openapi.json").json()["info"]["version"] == __version__
