"""The flags of the commands that fit a part beside a trained model (evidence, grounder, presence, regions), and
the model they load with its training images split into the part it was trained on and its validation part."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from fragsearch.model.bundle import Bundle
from fragsearch.training.refit import Refit


def refit_parser(description: str | None, what: str, epochs: int | None = None) -> argparse.ArgumentParser:
    """The flags: the model, the folder it is written to (with `what`), the data, Entities, cache, workers, and
    for a head trained here its `epochs` (the best on the validation part kept)."""
    from fragsearch.settings import default_cache_dir, default_data_dir

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a model in the runtime's form (folder or model.json)")
    ap.add_argument("--out", type=Path, required=True, help=f"the folder the model is written to, with its {what}")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--entities", type=Path, default=None,
                    help="the Flickr30k Entities folder (default: flickr30k-entities beside the Flickr8K folder)")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature and parse cache")
    ap.add_argument("--workers", type=int, default=2, help="extraction processes for images not cached")
    if epochs is not None:
        ap.add_argument("--epochs", type=int, default=epochs, help="epochs, the best on the validation part kept")
    return ap


def load_refit(args: argparse.Namespace, module: str, argv: Sequence[str] | None) -> Refit:
    """The model of `args` and its training images, split as its --selection val split them."""
    from fragsearch.model.dataset import load_split_data
    from fragsearch.model.parsers import make_parser
    from fragsearch.settings import default_places
    from fragsearch.training.calibrate import split_of

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bundle = Bundle.load(args.model, places=default_places(args.cache))
    train = load_split_data(args.data, "train", bundle.image_cfg, args.cache, make_parser(bundle.text.cfg.parser),
                            args.workers)
    rest, val = split_of(bundle, train)
    command = " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])
    return Refit(bundle, rest, val, args.entities or args.data.parent / "flickr30k-entities", command)
