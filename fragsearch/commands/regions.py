"""The command line of training/regions.py (`python -m fragsearch.training.regions`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence

import numpy as np

import fragsearch.training.regions as library
from fragsearch.commands.flags import add_region_flags, settings_of, with_region_flags
from fragsearch.commands.refit import entities_of, refit_parser
from fragsearch.model.bundle import Bundle
from fragsearch.model.image import RegionExtractor, max_softmax
from fragsearch.model.regions import GEOMETRY
from fragsearch.training.graphs import make_graphs
from fragsearch.training.regions import EPOCHS, HIDDEN, IMAGES, MIN_BOX_FRAC, fit_ranker, held, pictures_of

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    import sys

    from fragsearch.model.data import load_split
    from fragsearch.model.dataset import held_out_indices
    from fragsearch.model.entities import read_entities

    ap = refit_parser(library.__doc__, prog, "region ranker", epochs=EPOCHS)
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="the ranker's hidden units")
    ap.add_argument("--images", type=int, default=IMAGES, help="images of the part trained on that it reads")
    add_region_flags(ap, ("min_box_frac",))
    ap.set_defaults(min_box_frac=MIN_BOX_FRAC)  # the ranker's own default (training/regions.py), not the model's
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    command = " ".join(["python -m fragsearch.training.regions", *(sys.argv[1:] if argv is None else argv)])
    bundle = Bundle.load(args.model, places=settings.places)
    make_graphs(bundle.image_cfg, settings.places, head=True)  # the export step: what its extraction runs
    selection = bundle.meta.get("train", {})
    if selection.get("selection") != "val":
        raise SystemExit("the model was not trained with --selection val: it has no validation part to choose on")
    split = load_split(settings.data, "train")
    held_out = np.zeros(len(split.images), bool)
    held_out[held_out_indices(len(split.images), int(selection["val_images"]), int(selection["val_seed"]))] = True
    rest = np.flatnonzero(~held_out)
    rest = np.sort(np.random.default_rng(0).permutation(rest)[: args.images])
    val = np.flatnonzero(held_out)
    entities = read_entities(entities_of(args, settings),
                             [split.images[k] for k in (*rest, *val)])
    cfg = with_region_flags(dataclasses.replace(bundle.image_cfg, region_ranker=""), args)
    train_pictures = pictures_of(cfg, [split.image_path(split.images[k]) for k in rest], entities, "train images")
    val_pictures = pictures_of(cfg, [split.image_path(split.images[k]) for k in val], entities, "validation images")
    ranker, report = fit_ranker(train_pictures, val_pictures, cfg, args.hidden, args.epochs)
    before_pictures = pictures_of(bundle.image_cfg, [split.image_path(split.images[k]) for k in val], entities,
                                  "validation, the model's settings")
    head = RegionExtractor(dataclasses.replace(bundle.image_cfg, region_ranker=""), places=bundle.places).ranker
    before = held(before_pictures, (max_softmax(head.classify(p.pooled.astype(np.float32))) for p in before_pictures),
                  bundle.image_cfg)
    after = held(val_pictures, (ranker.score(p.pooled, p.boxes, p.width, p.height) for p in val_pictures), cfg)
    ceiling = held(val_pictures, (p.labels() for p in val_pictures), cfg)
    name = ranker.save(bundle.places.graphs).name
    ranker.save(args.out)
    bundle.image_cfg = dataclasses.replace(cfg, region_ranker=name)
    bundle.save(args.out)
    result = {"ranker": name, "command": command, "min_box_frac": args.min_box_frac, "inputs": ranker.features
              + GEOMETRY, "hidden": args.hidden, **report,
              "validation": {"images": len(val_pictures), "model_settings": before, "ranker": after,
                             "proposals_positive_first": ceiling}}
    (args.out / "regions.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    logger.info("validation phrases held by the regions: %.1f %% with the model's settings, %.1f %% ranked "
                "(proposals' positives first: %.1f %%); wrote %s", before["all"], after["all"], ceiling["all"],
                args.out)
