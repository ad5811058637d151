"""The command line of training/grounder.py (`python -m fragsearch.training.grounder`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace

import fragsearch.training.grounder as library
from fragsearch.commands.flags import settings_of
from fragsearch.commands.refit import entities_of, load_refit, refit_parser
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import held_out_split, load_split_data
from fragsearch.model.entities import read_entities
from fragsearch.model.parsers import make_parser
from fragsearch.training.graphs import make_graphs
from fragsearch.training.grounder import (
    EPOCHS,
    HIDDEN,
    REFINE_EPOCHS,
    REFINE_HIDDEN,
    choose_fusion,
    fit_grounder,
    fit_refiner,
    samples_of,
)

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    ap = refit_parser(library.__doc__, prog, "grounder", epochs=EPOCHS)
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="the head's hidden units")
    ap.add_argument("--fusion-only", action="store_true",
                    help="keep the model's head; choose only the box it draws (fused_box's temperature and overlap) "
                         "on the validation part, reading that part alone")
    ap.add_argument("--refine-only", action="store_true",
                    help="keep the model's head; train only its box refiner (and choose the box it draws again)")
    ap.add_argument("--refine-hidden", type=int, default=REFINE_HIDDEN, help="the box refiner's hidden units")
    ap.add_argument("--refine-epochs", type=int, default=REFINE_EPOCHS,
                    help="the box refiner's epochs, the best on the validation part kept")
    args = ap.parse_args(argv)
    if args.fusion_only:
        _fusion_only(ap, args, argv)
        return
    run = load_refit(ap, args, "fragsearch.training.grounder", argv)
    ents = run.all_entities()
    rest, val = samples_of(run.bundle, run.rest, ents), samples_of(run.bundle, run.val, ents)
    if args.refine_only:
        if run.bundle.grounder is None:
            ap.error(f"{args.model} has no grounder to refine the boxes of: train one first (without --refine-only)")
        fit = run.bundle.grounder
    else:
        fit, report = fit_grounder(rest, val, args.hidden, args.epochs)
        logger.info("grounder on the validation part: %s", {k: v for k, v in report.items() if k != "history"})
    fit, refined = fit_refiner(fit, rest, val, args.refine_hidden, args.refine_epochs)
    logger.info("box refiner on the validation part: %s", {k: v for k, v in refined.items() if k != "history"})
    run.bundle.grounder = replace(fit, state={**fit.state, ("refine_command" if args.refine_only else "command"):
                                              run.command})
    run.bundle.save(args.out)
    logger.info("wrote %s", args.out)


def _fusion_only(ap: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    """The model's own head with the box it draws chosen on the validation part (read alone), written to --out."""
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bundle = Bundle.load(args.model, places=settings.places)
    if bundle.grounder is None:
        ap.error(f"{args.model} has no grounder to draw boxes with: train one first (without --fusion-only)")
    selection = bundle.meta.get("train", {})
    if selection.get("selection") != "val":
        ap.error("the model was not trained with --selection val: it has no validation part to choose on")
    make_graphs(bundle.image_cfg, settings.places)
    split = held_out_split(load_split(settings.data, "train"), int(selection["val_images"]),
                           int(selection["val_seed"]))
    val = load_split_data(settings.data, split, bundle.image_cfg, settings.cache,
                          make_parser(bundle.text.cfg.parser), settings.worker_count)
    g = bundle.grounder
    fusion = choose_fusion(g, samples_of(bundle, val, read_entities(entities_of(args, settings), val.names)))
    command = " ".join(["python -m fragsearch.training.grounder", *(sys.argv[1:] if argv is None else argv)])
    bundle.grounder = replace(g, state={**g.state, "fusion": fusion, "fusion_command": command})
    logger.info("the box drawn, chosen on the validation part: %s", fusion)
    bundle.save(args.out)
    logger.info("wrote %s", args.out)

