"""The command line of training/finetune.py (`python -m fragsearch.training.finetune`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path

import numpy as np

import fragsearch.training.finetune as library
from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.model.config import TrainConfig
from fragsearch.model.dataset import load_split_data, select_images
from fragsearch.model.onnx import set_threads
from fragsearch.model.parsers import make_parser
from fragsearch.training.cutpoint import CutStore
from fragsearch.training.finetune import finetune
from fragsearch.training.graphs import make_graphs
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.selection import split_for_selection
from fragsearch.training.train import make_run

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", type=Path, required=True, help="the trained model fine-tuning starts from (model.pt)")
    ap.add_argument("--acts", type=Path, required=True, help="the cut-point activations (training/cutpoint.py)")
    ap.add_argument("--out", type=Path, required=True, help="the folder model.pt, backbone.pt, history.json go to")
    add_setting_flags(ap, ("data", "cache", "threads"))  # threads: torch's too
    ap.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs (each image once per epoch)")
    ap.add_argument("--anneal-epochs", type=int, default=1, help="last fine-tuning epochs at lr x 0.1")
    ap.add_argument("--lr", type=float, default=1e-4, help="the fragment model's learning rate (Adam)")
    ap.add_argument("--cnn-lr", type=float, default=1e-4, help="the backbone top's learning rate (Adam)")
    ap.add_argument("--captions-per-image", type=int, default=1, help="captions of each image per epoch")
    ap.add_argument("--train-limit", type=int, default=None, help="only the first N training images (tests)")
    ap.add_argument("--stored-only", action="store_true",
                    help="train on the training images whose activations are stored (a store stopped early)")
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.threads is not None:
        set_threads(settings.threads)
    bundle = Checkpoint.load(args.init)
    train_cfg = dataclasses.replace(_train_config(bundle), device="cpu")
    variant = str(bundle.meta.get("variant", "full"))
    run = make_run(variant, {k: getattr(train_cfg, k) for k in ("selection", "val_images", "val_seed", "seed",
                                                                 "fragment_drop", "dense_epochs", "calibrate")})
    make_graphs(run.image, settings.places)  # the export step: what its extraction runs
    data = load_split_data(settings.data, "train", run.image, settings.cache, make_parser(run.text.parser), 1,
                           args.train_limit)
    tr, val = split_for_selection(run.train, data)
    if val is None:
        raise SystemExit("fine-tuning chooses its epoch on the validation part: the init run needs --selection val")
    store = CutStore.open(args.acts)
    if args.stored_only:  # a store stopped early holds a seeded random part of the training images
        stored = {n for n, ok in zip(store.names, store.done(), strict=True) if ok}
        tr = select_images(tr, np.flatnonzero([n in stored for n in tr.names]))
        logger.info("fine-tuning on the %d training images with stored activations", len(tr.names))
    summary = finetune(bundle, run, tr, val, store, args.out, settings.places, epochs=args.epochs,
                       anneal_epochs=args.anneal_epochs, lr=args.lr, cnn_lr=args.cnn_lr,
                       captions_per_image=args.captions_per_image)
    summary.update({"variant": f"{variant} + fine-tuned CNN top", "init": str(args.init),
                    "train_images": len(tr.names),
                    "command": "python -m fragsearch.training.finetune "
                               + shlex.join(sys.argv[1:] if argv is None else argv)})
    (args.out / "history.json").write_text(json.dumps(summary, indent=2))
    logger.info("kept fine-tuning epoch %d (val R-sum %.2f)", summary["selection"]["epoch"], summary["best"]["rsum"])


def _train_config(bundle: Checkpoint) -> TrainConfig:
    saved = dict(bundle.meta.get("train", {}))
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in saved.items() if k in known})
