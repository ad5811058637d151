"""The command line of training/release.py (`python -m fragsearch.training.release`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

import fragsearch.training.release as library
from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import load_split_data
from fragsearch.model.graphs import BACKBONE_NAME
from fragsearch.model.parsers import make_parser
from fragsearch.model.release import RELEASE_DIR
from fragsearch.training.evaluate import evaluate
from fragsearch.training.graphs import make_graphs
from fragsearch.training.release import manifest_of, write_release

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True,
                    help="the trained checkpoint (model.pt), or a model in the runtime's form, to release")
    ap.add_argument("--out", type=Path, default=RELEASE_DIR, help="the release folder (default: model/released)")
    add_setting_flags(ap, ("data", "cache", "workers"))
    ap.add_argument("--dev-split", default="dev", help="the split the release's dev metrics are measured on")
    ap.add_argument("--row", default=None,
                    help="the row of docs/results/flickr8k-dev.csv this release is (default: the model folder's "
                         "name, or for a model made from an earlier release that release's row)")
    ap.add_argument("--provenance", type=Path, default=None,
                    help="the manifest.json of the release this model was made from (e.g. its relevance scale "
                         "refitted by training.calibrate --relevance-only): its training provenance is kept")
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    before = json.loads(args.provenance.read_text()) if args.provenance else None
    bundle = Bundle.load(args.model, device="cpu", places=settings.places)
    if bundle.relevance is None or not bundle.meta.get("selection", {}).get("val"):
        ap.error(f"{args.model} has no relevance scale or no validation metrics: a release is trained with "
                 "--selection val (python -m fragsearch.training.train --selection val ...)")
    if bundle.image_cfg.backbone != BACKBONE_NAME:
        ap.error(f"{args.model} needs the {bundle.image_cfg.backbone} weight package, which the project does not "
                 "install: a release uses the locked packages only")
    make_graphs(bundle.image_cfg, settings.places, [None], head=True)  # the export step: what the release ships
    dev_data = load_split_data(settings.data, args.dev_split, bundle.image_cfg, settings.cache,
                               make_parser(bundle.text.cfg.parser), workers=settings.worker_count)
    dev = evaluate(bundle, dev_data)
    logger.info("dev R-sum %.2f (annotation R@1 %.1f, search R@1 %.1f)", dev["rsum"], dev["annot_r1"],
                dev["search_r1"])
    command = "python -m fragsearch.training.release " + shlex.join(sys.argv[1:] if argv is None else argv)
    manifest = write_release(bundle, args.out, manifest_of(bundle, args.model, settings.data, dev, command, before,
                                                           args.row))
    Bundle.load(args.out)  # the release loads, checked against its manifest
    logger.info("released %s into %s: %s", manifest["name"], args.out,
                ", ".join(f"{n} {f['bytes'] / 1e6:.1f} MB" for n, f in manifest["files"].items()))
