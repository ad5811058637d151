"""The command line of training/cutpoint.py (`python -m fragsearch.training.cutpoint`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import fragsearch.training.cutpoint as library
from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.model.onnx import default_threads
from fragsearch.model.variants import load_variant
from fragsearch.training.cutpoint import DEFAULT_CUT, extract

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setting_flags(ap, ("data", "cache", "threads", "variant"))  # variant: whose regions; default full
    ap.add_argument("--splits", nargs="+", default=["train", "dev"], help="the splits whose images are stored")
    ap.add_argument("--cut", type=int, default=DEFAULT_CUT, help="MBConv blocks below the cut (Lite0 has 16)")
    ap.add_argument("--out", type=Path, required=True, help="the store's folder")
    ap.add_argument("--val-images", type=int, default=500, help="the validation part's images, stored first")
    ap.add_argument("--val-seed", type=int, default=0, help="the validation part's draw")
    ap.add_argument("--order-seed", type=int, default=0, help="then the first split in this seeded order")
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    image = load_variant(settings.variant or "full").image
    store = extract(settings.data, args.splits, image, settings.cache, args.out, args.cut,
                    settings.threads or default_threads(), val_images=args.val_images, val_seed=args.val_seed,
                    order_seed=args.order_seed)
    logger.info("%s: %d images, %s per fragment, %.2f GB", store.folder, len(store.names), store.shape,
                store.acts_path.stat().st_size / 1e9)
