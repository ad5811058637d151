"""The command line of training/merge.py (`python -m fragsearch.training.merge`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import fragsearch.training.merge as library
from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.model.config import TrainConfig
from fragsearch.model.dataset import load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.training.graphs import make_graphs
from fragsearch.training.merge import THRESHOLDS, merge_bundles, merge_selected
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.selection import split_for_selection


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=Path, nargs="+", required=True, help="model folders (each with model.pt)")
    ap.add_argument("--out", type=Path, required=True, help="the merged model's folder")
    ap.add_argument("--threshold", choices=THRESHOLDS, default="blocks",
                    help="blocks: each member's fragment scores thresholded apart (an ensemble's score); "
                         "sum: their sum thresholded (one block)")
    add_setting_flags(ap, ("data", "cache"))
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(args.members) < 2:
        ap.error("a merge needs at least two --members")
    start = time.perf_counter()
    bundles = [Checkpoint.load(folder / "model.pt") for folder in args.members]
    try:  # members that cannot be merged are refused before the training data is loaded (a merge takes milliseconds)
        merge_bundles(bundles, args.threshold)
    except ValueError as e:
        ap.error(str(e))
    first = bundles[0]
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in first.meta.get("train", {}).items() if k in known})
    make_graphs(first.image_cfg, settings.places)  # the export step: what its extraction runs
    data = load_split_data(settings.data, "train", first.image_cfg, settings.cache, make_parser(first.text.cfg.parser))
    tr, val = split_for_selection(cfg, data)
    merged, summary = merge_selected(bundles, args.members, tr, val, cfg, settings.cache, args.threshold)
    merged.save(args.out / "model.pt")
    summary["train_seconds"] = time.perf_counter() - start
    summary["command"] = "python -m fragsearch.training.merge " + shlex.join(sys.argv[1:] if argv is None else argv)
    (args.out / "history.json").write_text(json.dumps(summary, indent=2))
