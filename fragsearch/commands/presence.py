"""The command line of training/presence.py (`python -m fragsearch.training.presence`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import fragsearch.training.presence as library
from fragsearch.commands.refit import load_refit, refit_parser
from fragsearch.model.evidence import PresenceHead
from fragsearch.training.presence import EPOCHS, PER_IMAGE, fit_presence, samples_of

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    from fragsearch.training.evidence import refit_evidence

    ap = refit_parser(library.__doc__, prog, "presence head and phrase evidence", epochs=EPOCHS)
    ap.add_argument("--per-image", type=int, default=PER_IMAGE, help="captions of each training picture read")
    args = ap.parse_args(argv)
    run = load_refit(ap, args, "fragsearch.training.presence", argv)
    ents = run.all_entities()
    val = samples_of(run.bundle, run.val, ents, per_image=5, seed=1)
    train = samples_of(run.bundle, run.rest, ents, per_image=args.per_image)
    head, report = fit_presence(train, val, epochs=args.epochs)
    logger.info("presence head on the validation part: %s", {k: v for k, v in report.items() if k != "history"})
    run.bundle.presence = PresenceHead(head.p, head.q, head.w1, head.b1, head.w2, head.b2,
                                       {**head.state, "command": run.command})
    refit_evidence(run, args.out)
