"""The command line of training/calibrate.py (`python -m fragsearch.training.calibrate`): its flags, read at the door.
What it does is that module's docstring, the --help text."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import fragsearch.training.calibrate as library
from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.model.dataset import load_split_data
from fragsearch.model.onnx import default_threads
from fragsearch.model.parsers import make_parser
from fragsearch.training.calibrate import fit_calibration, fit_relevance_on_validation, per_item_ms, refit_relevance
from fragsearch.training.evaluate import evaluate
from fragsearch.training.graphs import make_graphs
from fragsearch.training.nets.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=library.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="checkpoint to calibrate (rewritten in place)")
    ap.add_argument("--out", type=Path, default=None, help="write the calibrated checkpoint here instead")
    ap.add_argument("--relevance-only", action="store_true",
                    help="keep the reference sets and refit only the relevance scale (on the validation part)")
    add_setting_flags(ap, ("data", "cache", "workers", "device"))
    ap.add_argument("--split", default="train", help="where the reference items are drawn from")
    ap.add_argument("--dev-split", default="dev",
                    help="evaluated before and after ('' to skip)")
    ap.add_argument("--refs", type=int, default=1000, help="reference images and sentences (0 removes calibration)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the reference draw")
    ap.add_argument("--local-k", default=None, metavar="K[,K...]",
                    help="with --relevance-only: choose a local scale on the validation part among these k (the "
                    "reference scores an item's local scale averages) and --local-power, or the spread alone")
    ap.add_argument("--local-power", default="0.5,0.75,1.0", metavar="P[,P...]",
                    help="with --local-k: the local scale's weights tried (default 0.5,0.75,1.0)")
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    local = None
    if args.local_k is not None:
        if not args.relevance_only:
            ap.error("--local-k is chosen on the validation part: give it with --relevance-only")
        try:
            local = ([int(k) for k in args.local_k.split(",")], [float(p) for p in args.local_power.split(",")])
        except ValueError:
            ap.error("--local-k and --local-power take comma-separated numbers (20 or 10,20; 0.5,0.75)")
        if any(k < 1 for k in local[0]) or any(p <= 0 for p in local[1]):
            ap.error("--local-k values must be >= 1 and --local-power values > 0")
    if args.relevance_only:
        refit_relevance(args.model, args.out or args.model, settings.data, settings.cache, settings.worker_count,
                        settings.device, local)
        return
    bundle = Checkpoint.load(args.model, device=settings.device)
    make_graphs(bundle.image_cfg, settings.places)  # the export step: what its extraction runs
    device = str(bundle.device)
    if bundle.cfg.kind != "fragment":
        raise SystemExit(f"{args.model}: only fragment models are calibrated (this one is {bundle.cfg.kind!r})")
    parser = make_parser(bundle.text.cfg.parser)
    workers = settings.worker_count
    dev = (load_split_data(settings.data, args.dev_split, bundle.image_cfg, settings.cache, parser, workers,
                           device=device) if args.dev_split else None)
    if dev is not None:
        bundle.text.warm(dev.parsed, dev.sentences, settings.cache / "vectors")
    train = load_split_data(settings.data, args.split, bundle.image_cfg, settings.cache, parser, workers,
                            device=device) if args.refs > 0 else None
    out = args.out or args.model
    bundle.calibration = None
    before = evaluate(bundle, dev) if dev is not None else None
    if args.refs > 0 and train is not None:
        bundle.calibration = fit_calibration(bundle, train, args.refs, args.seed)
        bundle.meta["calibration"] = {"refs": args.refs, "split": args.split, "seed": args.seed}
        if bundle.meta.get("train", {}).get("selection") == "val":
            fit_relevance_on_validation(bundle, train, settings.cache)
        else:
            logger.warning("no validation part in %s (not trained with --selection val): no relevance scale",
                           args.model)
    else:
        bundle.meta.pop("calibration", None)
    bundle.meta.pop("dev", None)  # measured with the previous scales
    if dev is not None:
        after = evaluate(bundle, dev)
        bundle.meta["dev"] = after
        keys = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10")
        logger.info("dev without calibration: %s", json.dumps({k: round(before[k], 1) for k in keys} if before else {}))
        logger.info("dev with calibration:    %s", json.dumps({k: round(after[k], 1) for k in keys}))
        if bundle.calibration is not None:
            cost = per_item_ms(bundle.bundle(), dev)
            bundle.meta["calibration"]["ms_per_item"] = cost
            logger.info("median ms to embed one item (dev, %d threads): %s", default_threads(), json.dumps(cost))
    bundle.save(out)
    logger.info("wrote %s", out)
