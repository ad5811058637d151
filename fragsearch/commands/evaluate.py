"""The command line of training/evaluate.py (`python -m fragsearch.training.evaluate`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import fragsearch.training.evaluate as library
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.settings import default_cache_dir, default_data_dir, default_model_path, default_places
from fragsearch.training.evaluate import evaluate

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_dir(),
                    help="the Flickr8K folder (default: FRAGSEARCH_DATA or ../shared/data/flickr8k)")
    ap.add_argument("--split", default="dev",
                    help="split name (DATA/<name>.txt) or path of a split list")
    ap.add_argument("--model", type=Path, default=default_model_path(),
                    help="the checkpoint (model.pt); default: the served model (model/release.py: the released one "
                         "unless FRAGSEARCH_MODEL_PATH or FRAGSEARCH_VARIANT names another)")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(),
                    help="the feature, parse and vector cache (git-ignored); default: artifacts/cache")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
    ap.add_argument("--limit", type=int, default=None, help="only the first N images of the split")
    ap.add_argument("--out", type=Path, default=None, help="write the metrics as JSON here")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bundle = Bundle.load(args.model, device=args.device, places=default_places(args.cache))
    data = load_split_data(args.data, args.split, bundle.image_cfg, args.cache,
                           make_parser(bundle.text.cfg.parser), workers=args.workers, limit=args.limit,
                           device=str(bundle.device))
    metrics = evaluate(bundle, data)
    text = json.dumps(metrics, indent=2)
    logger.info("metrics on %s (%d images): %s", args.split, len(data.names), text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
