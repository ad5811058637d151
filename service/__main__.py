"""The embedded default: prepare what is missing, then serve on 127.0.0.1:8000.

    python -m service [--host H] [--port P] [--no-prepare]

Settings come from FRAGSEARCH_* environment variables or `.env` (see service/settings.py);
the flags override them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import uvicorn

from model.data import DataError
from service.app import create_app
from service.prepare import prepare
from service.settings import Settings

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--no-prepare", action="store_true", help="serve what exists; do not train or index")
    args = ap.parse_args(argv)
    started = process_started()
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if args.no_prepare:
        overrides["prepare"] = False
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.writes_open and settings.auth_disabled:
        logger.warning("auth is disabled: anyone who can reach the port can add and delete images")
    elif not settings.writes_open:
        logger.info("no API key configured (FRAGSEARCH_API_KEY): POST/DELETE /images are refused")
    if settings.prepare:
        try:
            prepare(settings)
        except DataError as e:
            logger.error("cannot prepare: %s (set FRAGSEARCH_DATA to the Flickr8K folder)", e)
            return 2
    app = create_app(settings, started=started)
    logger.info("serving on http://%s:%d (ready when /readyz answers 200)", settings.host, settings.port)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
