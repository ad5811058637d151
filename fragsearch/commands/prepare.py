"""The command line of service/prepare.py (`python -m fragsearch.service.prepare`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import logging
import threading

import fragsearch.service.prepare as library
from fragsearch.commands.options import settings_from, settings_parser
from fragsearch.model.data import DataError
from fragsearch.model.device import DeviceError, device_name
from fragsearch.service import logs
from fragsearch.service.prepare import BackendMissing, ModelMissing, Progress, log_progress, prepare

logger = logging.getLogger("fragsearch.service.prepare")  # the preparation's own lines, one name


def main(argv: list[str] | None = None, prog: str = "python -m fragsearch.service.prepare") -> int:
    """The one-shot preparation: exit 0 when everything is prepared, 2 with one line when it cannot be
    (a bad flag or setting: argparse's message, status 2)."""
    ap = settings_parser(prog, library.__doc__)
    settings = settings_from(ap, ap.parse_args(argv))
    try:
        logs.configure(settings.log_level, settings.log_format)
        device = device_name(settings.device)
    except DeviceError as e:
        logs.configure("info", "text")
        logger.error("cannot start: %s", e)
        return 2
    logger.info("preparing on %s with %d extraction workers: data %s, artifacts %s%s", device,
                settings.worker_count, settings.data, settings.artifacts,
                "" if settings.limit is None else f", the first {settings.limit} images of each split")
    progress = Progress()
    stop = threading.Event()
    threading.Thread(target=log_progress, args=(progress, settings.progress_every, stop), daemon=True).start()
    try:
        prepare(settings, progress)
    except DataError as e:
        logger.error("cannot prepare: %s (%s)", e, settings.data_hint())
        return 2
    except (ModelMissing, BackendMissing) as e:
        logger.error("cannot prepare: %s", e)
        return 2
    finally:
        stop.set()
    progress.finish()
    return 0
