"""The command line of training/evidence.py (`python -m fragsearch.training.evidence`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

from collections.abc import Sequence

import fragsearch.training.evidence as library
from fragsearch.commands.refit import load_refit, refit_parser
from fragsearch.training.evidence import refit_evidence


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    ap = refit_parser(library.__doc__, prog, "evidence")
    ap.add_argument("--relevance-only", action="store_true",
                    help="keep the model's phrase evidence and refit the relevance on it alone")
    args = ap.parse_args(argv)
    refit_evidence(load_refit(ap, args, "fragsearch.training.evidence", argv), args.out, args.relevance_only)
