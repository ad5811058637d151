"""The command line of model/flickr8k.py (`python -m fragsearch.model.flickr8k`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import fragsearch.model.flickr8k as library
from fragsearch.model.data import DataError
from fragsearch.model.flickr8k import check, convert, layout_of, log_report

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the official download, the CSV mirror, or a project-layout folder "
                    "(then it is checked only)")
    ap.add_argument("dest", type=Path, nargs="?", help="where the project's layout is written (needed unless SRC "
                    "is in it already)")
    ap.add_argument("--splits", type=Path, default=None, help="the folder with the official split lists "
                    "(Flickr_8k.trainImages.txt, Flickr_8k.devImages.txt): required for the CSV mirror")
    ap.add_argument("--copy", action="store_true", help="copy the images instead of hard-linking them")
    ap.add_argument("--no-decode", action="store_true", help="check without decoding every image (faster)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        layout = layout_of(args.src)
        if layout == "project" and args.dest is None:
            folder = args.src
        elif args.dest is None:
            raise DataError(f"{args.src} is the {layout} layout: give DEST, the folder the project's layout is "
                            f"written to (./run data {args.src} DEST)")
        else:
            folder = convert(args.src, args.dest, args.splits, args.copy)
        report = check(folder, decode=not args.no_decode)
    except (DataError, OSError) as e:
        logger.error("%s", e)
        return 2
    log_report(report)
    return 0 if report.ok else 1
