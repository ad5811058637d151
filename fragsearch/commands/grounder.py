"""The command line of training/grounder.py (`python -m fragsearch.training.grounder`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import fragsearch.training.grounder as library
from fragsearch.commands.refit import load_refit, refit_parser
from fragsearch.model.grounder import Grounder
from fragsearch.training.grounder import EPOCHS, HIDDEN, fit_grounder, samples_of

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    ap = refit_parser(library.__doc__, prog, "grounder", epochs=EPOCHS)
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="the head's hidden units")
    args = ap.parse_args(argv)
    run = load_refit(ap, args, "fragsearch.training.grounder", argv)
    ents = run.all_entities()
    fit, report = fit_grounder(samples_of(run.bundle, run.rest, ents), samples_of(run.bundle, run.val, ents),
                               args.hidden, args.epochs)
    run.bundle.grounder = Grounder(fit.w1, fit.b1, fit.w2, fit.b2, {**fit.state, "command": run.command})
    logger.info("grounder on the validation part: %s", {k: v for k, v in report.items() if k != "history"})
    run.bundle.save(args.out)
    logger.info("wrote %s", args.out)
