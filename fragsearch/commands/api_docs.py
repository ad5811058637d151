"""The command line of service/openapi_doc.py (`python -m fragsearch.service.openapi_doc`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
from pathlib import Path

import fragsearch.service.openapi_doc as library
from fragsearch.model.atomic import atomic_file
from fragsearch.model.places import ROOT
from fragsearch.service.openapi_doc import api_files

DEFAULT_OUT = ROOT / "docs" / "api"  # the checkout's, beside the other docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=library.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="folder to write openapi.json and reference.md into (default: docs/api)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in api_files().items():
        with atomic_file(args.out / name) as f:
            f.write(text.encode())
    return 0
