"""The command line of training/train.py (`python -m fragsearch.training.train`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from dataclasses import fields
from pathlib import Path

import fragsearch.training.train as library
from fragsearch.commands.flags import (
    add_field_flag,
    add_region_flags,
    add_setting_flags,
    settings_of,
    with_region_flags,
)
from fragsearch.model.config import SELECTIONS, TrainConfig
from fragsearch.model.variants import VariantError, field_meanings, variant_names
from fragsearch.training.train import MODEL_OPTIONS, list_resolved, list_variants, make_run, train_on

logger = logging.getLogger(__name__)

FLAG_HELP = {
    "selection": "which epoch is kept: val = the best R-sum on --val-images training images held out of training "
                 "(never dev); last = the last epoch, every training image trained on (a fixed epoch count)",
    "val_images": "training images (with their captions) held out as the validation part of --selection val",
    "val_seed": "seed of the draw of the validation part (fixed: the same images in every run)",
    "eval_every": "epochs between evaluations on the validation part (--selection val)",
}


def _add_config_flags(ap: argparse.ArgumentParser) -> None:
    """A flag for each field of the trainer's settings (TrainConfig; its meaning from model/variants/README.md)
    and of the model's shape a variant may set (ModelConfig), each None unless given: the variant's."""
    meanings = field_meanings("train")
    hints = typing.get_type_hints(TrainConfig)
    group = ap.add_argument_group("training (TrainConfig: each overrides the variant's where given)")
    for f in fields(TrainConfig):
        if f.name == "device":  # the device setting's flag (training runs where the settings say)
            continue
        say = FLAG_HELP.get(f.name) or meanings.get(f.name)
        add_field_flag(group, f.name, hints[f.name], boolean_value=True,
                       help=f"{say} ({'true/false; ' if hints[f.name] is bool else ''}default: the variant's)",
                       choices=SELECTIONS if f.name == "selection" else None, made_from=f"TrainConfig.{f.name}")
    group = ap.add_argument_group("model shape (ModelConfig: each overrides the variant's where given)")
    for name, typ in MODEL_OPTIONS.items():
        add_field_flag(group, name, typ, help="model shape (ModelConfig)", made_from=f"ModelConfig.{name}")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the variants (model/variants/*.toml) and exit")
    ap.add_argument("--resolved", action="store_true",
                    help="print every field of every variant (of --variant when given) as resolved, as TOML, "
                         "and exit (python -m fragsearch.training.train --list --resolved)")
    add_setting_flags(ap, ("data", "cache", "workers", "variant", "device"))  # variant: default full
    ap.add_argument("--out", type=Path, default=None,
                    help="default: artifacts/models/<variant>")
    ap.add_argument("--train-split", default="train", help="split whose images and captions are trained on")
    ap.add_argument("--dev-split", default=None,
                    help="only '' is accepted, the old spelling of --selection last (dev never selects a model)")
    ap.add_argument("--train-limit", type=int, default=None, help="only the first N training images")
    add_region_flags(ap)  # each defaults to the variant's
    _add_config_flags(ap)
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    if args.resolved:
        try:
            list_resolved(sys.stdout, variant_names() if settings.variant is None else [settings.variant])
        except VariantError as exc:
            ap.error(str(exc))
        return
    if args.list:
        list_variants(sys.stdout)
        return
    if args.dev_split not in (None, ""):
        ap.error("--dev-split: dev is never used to select a model (python -m bench.report evaluates it); "
                 "--selection val holds out training images instead, --selection last keeps the last epoch")
    if args.dev_split == "" and args.selection not in (None, "last"):
        ap.error("--dev-split '' means --selection last")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
                 if f.name != "device" and getattr(args, f.name) is not None}
    overrides["device"] = settings.device
    if args.dev_split == "":
        overrides["selection"] = "last"
    shape = {k: getattr(args, k) for k in MODEL_OPTIONS if getattr(args, k) is not None}
    try:
        run = make_run(settings.variant or "full", overrides, shape)
    except VariantError as exc:
        ap.error(str(exc))
    run.image = with_region_flags(run.image, args)
    out = args.out or settings.artifacts / "models" / run.variant
    train_on(run, settings.data, out, settings.cache, sys.argv[1:] if argv is None else argv, split=args.train_split,
             workers=settings.worker_count, limit=args.train_limit, places=settings.places)
