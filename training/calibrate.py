"""Score calibration: fitting the reference sets (model/calibration.py holds the data and its maths),
timing it, and the command line that calibrates a trained checkpoint.

The reference sets are drawn from the training split (`fit_calibration`), embedded by the
uncalibrated model and stored in the checkpoint; `per_item_ms` measures what the scale costs a query.

    python -m training.calibrate --model artifacts/models/full/model.pt --refs 1000
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from model.bundle import Bundle
from model.calibration import Calibration
from model.config import default_artifacts_dir, default_data_dir
from model.dataset import SplitData, load_split_data
from model.parsers import make_parser
from training.evaluate import evaluate

logger = logging.getLogger(__name__)

FLOOR = 0.01  # smallest scale, as a share of the reference items' median scale (an all-zero item)


def fit_calibration(bundle: Bundle, data: SplitData, refs: int, seed: int = 0) -> Calibration:
    """Reference sets of `refs` images and `refs` sentences drawn from `data` (the training split),
    embedded by the bundle's model without calibration; floors from the references' own scales."""
    rng = np.random.default_rng(seed)
    img_idx = np.sort(rng.choice(len(data.names), min(refs, len(data.names)), replace=False))
    sent_idx = np.sort(rng.choice(len(data.sentences), min(refs, len(data.sentences)), replace=False))
    enc = bundle.text.encode_parsed([data.parsed[i] for i in sent_idx], [data.sentences[i] for i in sent_idx])
    was_training = bundle.model.training
    bundle.model.eval()
    with torch.no_grad():
        img = bundle.embed_images(data.feats[img_idx], calibrated=False)
        sent, mask = bundle.embed_sentences(enc, calibrated=False)
    bundle.model.train(was_training)
    cal = Calibration(img, sent, mask).to(bundle.device)
    cal.floor_image = FLOOR * float(cal.image_scales(cal.ref_images).median())
    cal.floor_sentence = FLOOR * float(cal.sentence_scales(cal.ref_sentences, cal.ref_sentence_mask).median())
    return cal


def per_item_ms(bundle: Bundle, data: SplitData, n: int = 50) -> dict[str, float]:
    """Milliseconds to embed one image / one sentence at a time (as a query is), with and without
    the calibration scale, measured interleaved on the first `n` items of `data`."""
    enc = bundle.text.encode_parsed(data.parsed[:n], data.sentences[:n])
    times: dict[str, list[float]] = {k: [] for k in ("image", "image_calibrated", "sentence", "sentence_calibrated")}
    bundle.model.eval()
    with torch.no_grad():
        for i in range(min(n, len(data.names), len(enc.rel))):
            for cal in (False, True):
                t = time.perf_counter()
                bundle.embed_images(data.feats[i : i + 1], calibrated=cal)
                times["image_calibrated" if cal else "image"].append(time.perf_counter() - t)
                t = time.perf_counter()
                bundle.embed_sentences(enc, [i], calibrated=cal)
                times["sentence_calibrated" if cal else "sentence"].append(time.perf_counter() - t)
    return {k: round(1000 * float(np.median(v)), 2) for k, v in times.items() if v}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="checkpoint to calibrate (rewritten in place)")
    ap.add_argument("--data", type=Path, default=default_data_dir(),
                    help="the Flickr8K folder (default: FRAGSEARCH_DATA or ../shared/data/flickr8k)")
    ap.add_argument("--split", default="train", help="where the reference items are drawn from")
    ap.add_argument("--dev-split", default="dev",
                    help="evaluated before and after ('' to skip)")
    ap.add_argument("--cache", type=Path, default=default_artifacts_dir() / "cache",
                    help="the feature, parse and vector cache (git-ignored); default: artifacts/cache")
    ap.add_argument("--refs", type=int, default=1000, help="reference images and sentences (0 removes calibration)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the reference draw")
    ap.add_argument("--workers", type=int, default=1, help="feature extraction processes")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bundle = Bundle.load(args.model, device=args.device)
    device = str(bundle.device)
    if bundle.cfg.kind != "fragment":
        raise SystemExit(f"{args.model}: only fragment models are calibrated (this one is {bundle.cfg.kind!r})")
    parser = make_parser(bundle.text.cfg.parser)
    dev = (load_split_data(args.data, args.dev_split, bundle.image_cfg, args.cache, parser, args.workers,
                           device=device) if args.dev_split else None)
    if dev is not None:
        bundle.text.warm(dev.parsed, dev.sentences, args.cache / "vectors")
    bundle.calibration = None
    before = evaluate(bundle, dev) if dev is not None else None
    if args.refs > 0:
        train = load_split_data(args.data, args.split, bundle.image_cfg, args.cache, parser, args.workers,
                                device=device)
        bundle.calibration = fit_calibration(bundle, train, args.refs, args.seed)
        bundle.meta["calibration"] = {"refs": args.refs, "split": args.split, "seed": args.seed}
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
            cost = per_item_ms(bundle, dev)
            bundle.meta["calibration"]["ms_per_item"] = cost
            logger.info("median ms to embed one item (dev, torch threads: %d): %s", torch.get_num_threads(),
                        json.dumps(cost))
    bundle.save(args.model)
    logger.info("wrote %s", args.model)


if __name__ == "__main__":
    main()
