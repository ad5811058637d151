"""The embedded default: serve on 127.0.0.1:8000 at once and prepare what is missing meanwhile.

GET /healthz answers from the first second; GET /readyz answers 503 with what is still being prepared
(stage, items done / total, estimated time left) until the model and both indexes are loaded, and
searches are served as soon as the image index is.

    fragsearch serve [--host H] [--port P] [--no-prepare] [--config FILE] [--SETTING VALUE ...]

Every setting has a flag (`--help` lists them, docs/operations/settings.md is their table); the flags override
the FRAGSEARCH_* environment variables, `.env` and the settings file (./fragsearch.toml,
FRAGSEARCH_CONFIG or --config): fragsearch/commands/options.py.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import uvicorn

from fragsearch.commands.options import settings_from, settings_parser
from fragsearch.model.data import DataError, load_split
from fragsearch.model.device import DeviceError, device_name
from fragsearch.model.onnx import limit_numeric_threads, request_threads
from fragsearch.service import logs
from fragsearch.service.app import create_app
from fragsearch.service.version import __version__

logger = logging.getLogger("service")


def process_started() -> float:
    """The time.perf_counter() value at which this process started (Linux /proc; else now), so that
    the logged start-up time includes the imports."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.perf_counter() - max(0.0, uptime - started)
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


def main(argv: list[str] | None = None, prog: str = "python -m fragsearch.service") -> int:
    ap = settings_parser(prog, __doc__)
    ap.add_argument("--version", action="version", version=f"fragsearch {__version__}")
    args = ap.parse_args(argv)
    started = process_started()
    settings = settings_from(ap, args)
    logs.configure(settings.log_level, settings.log_format)
    try:
        device = device_name(settings.device)
    except DeviceError as e:
        logger.error("cannot start: %s", e)
        return 2
    if settings.writes_open and settings.auth_disabled:
        logger.warning("auth is disabled: anyone who can reach the port can add and delete images")
    elif not settings.writes_open:
        logger.info("no API key configured (FRAGSEARCH_API_KEY): POST/DELETE /images are refused")
    if settings.prepare and settings.mode == "split":  # a photo collection needs no data folder
        try:
            load_split(settings.data, settings.image_split)
        except DataError as e:
            logger.error("cannot prepare: %s (%s)", e, settings.data_hint())
            return 2
    threads = settings.numeric_threads or request_threads(settings.search_slots)
    logger.info("numeric threads: %s (%d per request, %d searches at once)", limit_numeric_threads(threads), threads,
                settings.search_slots)
    app = create_app(settings, started=started, prepare=settings.prepare)
    logger.info("serving on http://%s:%d on %s (ready when /readyz answers 200%s)", settings.host, settings.port,
                device, "; it reports what is still being prepared" if settings.prepare else "")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG)
    return 0
