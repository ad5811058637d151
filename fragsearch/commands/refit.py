"""The flags of the commands that fit a part beside a trained model (evidence, grounder, presence, regions), and
the model they load with its training images split into the part it was trained on and its validation part."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.model.bundle import Bundle
from fragsearch.settings import Settings
from fragsearch.training.graphs import make_graphs
from fragsearch.training.refit import Refit


def refit_parser(description: str | None, prog: str | None, what: str, epochs: int | None = None
                 ) -> argparse.ArgumentParser:
    """The flags: the model, the folder it is written to (with `what`), Entities, the data, cache and workers
    settings, and for a head trained here its `epochs` (the best on the validation part kept)."""
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a model in the runtime's form (folder or model.json)")
    ap.add_argument("--out", type=Path, required=True, help=f"the folder the model is written to, with its {what}")
    ap.add_argument("--entities", type=Path, default=None,
                    help="the Flickr30k Entities folder (default: flickr30k-entities beside the data folder)")
    if epochs is not None:
        ap.add_argument("--epochs", type=int, default=epochs, help="epochs, the best on the validation part kept")
    add_setting_flags(ap, ("data", "cache", "workers"))
    return ap


def entities_of(args: argparse.Namespace, settings: Settings) -> Path:
    """The Entities folder: --entities, else flickr30k-entities beside the data folder."""
    return Path(args.entities or settings.data.parent / "flickr30k-entities")


def load_refit(ap: argparse.ArgumentParser, args: argparse.Namespace, module: str, argv: Sequence[str] | None
               ) -> Refit:
    """The model of `args` and its training images (the settings `ap`'s flags give), split as its --selection val
    split them."""
    from fragsearch.model.dataset import load_split_data
    from fragsearch.model.parsers import make_parser
    from fragsearch.training.calibrate import split_of

    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bundle = Bundle.load(args.model, places=settings.places)
    make_graphs(bundle.image_cfg, settings.places)  # the export step: what its extraction runs
    train = load_split_data(settings.data, "train", bundle.image_cfg, settings.cache,
                            make_parser(bundle.text.cfg.parser), settings.worker_count)
    rest, val = split_of(bundle, train)
    command = " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])
    return Refit(bundle, rest, val, entities_of(args, settings), command)
