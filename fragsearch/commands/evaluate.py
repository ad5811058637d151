"""The command line of training/evaluate.py (`python -m fragsearch.training.evaluate`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import fragsearch.training.evaluate as library
from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.training.evaluate import evaluate
from fragsearch.training.graphs import make_graphs

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setting_flags(ap, ("data", "cache", "workers", "device", "limit"))
    ap.add_argument("--split", default="dev",
                    help="split name (DATA/<name>.txt) or path of a split list")
    ap.add_argument("--model", type=Path, default=None,
                    help="the checkpoint (model.pt); default: the served model, the model_path setting (the released "
                         "one unless FRAGSEARCH_MODEL_PATH or FRAGSEARCH_VARIANT names another)")
    ap.add_argument("--out", type=Path, default=None, help="write the metrics as JSON here")
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bundle = Bundle.load(args.model or settings.model_path, device=settings.device, places=settings.places)
    make_graphs(bundle.image_cfg, settings.places)  # the export step: what its extraction runs
    data = load_split_data(settings.data, args.split, bundle.image_cfg, settings.cache,
                           make_parser(bundle.text.cfg.parser), workers=settings.worker_count, limit=settings.limit,
                           device=str(bundle.device))
    metrics = evaluate(bundle, data)
    text = json.dumps(metrics, indent=2)
    logger.info("metrics on %s (%d images): %s", args.split, len(data.names), text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
