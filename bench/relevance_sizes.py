"""How the relevance scale holds as the collection grows: the relevance benchmark's measures (calibration
error, the share of matches among the pairs shown at relevance >= 0.5) on collections of several sizes drawn
from the validation part (what the scale is fitted on, up to its 500 images) and from dev:

    python -m bench.relevance_sizes --out docs/results/relevance-sizes.csv

A collection of N images is N images drawn at random (seeded; `--draws` of them below the split's size, the
split itself at its size) with their captions; each is measured as bench.relevance_bench measures dev (the 10
best results of every query both ways, a match by training.relevance.described_alike), with the relevance the
service gives each result in that collection. Writes one row per split and size: the means over the draws, with the
mean relevance of the pairs shown at >= 0.5 beside the share of them that are matches.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine, parse_run, write_rows
from bench.relevance_bench import measure
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import DEFAULT_CUTOFF
from fragsearch.model.data import load_split
from fragsearch.model.dataset import held_out_split, load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.settings import default_cache_dir, default_data_dir, default_model_path
from fragsearch.training.evaluate import evaluate_scores
from fragsearch.training.relevance import matches_of

logger = logging.getLogger("bench.relevance_sizes")
SIZES = (100, 250, 500, 1000)
MEASURES = (("search", "ece"), ("annotate", "ece"), ("search", "precision_at_cutoff"),
            ("annotate", "precision_at_cutoff"), ("search", "shown_at_cutoff"), ("annotate", "shown_at_cutoff"))

SIDES = ("search", "annotate")


def shown_relevance(table: list[dict[str, Any]], side: str) -> float:
    """The mean relevance of one direction's pairs shown at relevance >= the cut-off, from its reliability
    rows (bins from the cut-off up; NaN when none is shown): what their share of matches should be."""
    above = [r for r in table if r["direction"] == side and r["bin_low"] >= DEFAULT_CUTOFF and r["pairs"]]
    pairs = sum(r["pairs"] for r in above)
    return float(sum(r["pairs"] * r["predicted"] for r in above) / pairs) if pairs else float("nan")


def subset(pair_image: np.ndarray, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The captions of `images` (sorted ids) and each one's image renumbered 0 .. len(images) - 1."""
    sents = np.flatnonzero(np.isin(pair_image, images))
    return sents, np.searchsorted(images, pair_image[sents])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path(), help="a model with a relevance scale")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature, parse and vector cache")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="collection sizes (images)")
    ap.add_argument("--draws", type=int, default=3, help="collections drawn at each size below a split's")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draws")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
    ap.add_argument("--out", type=Path, default=Path("docs/results/relevance-sizes.csv"), help="the CSV written")
    args, command = parse_run(ap, argv, "bench.relevance_sizes")
    bundle = Bundle.load(args.model)
    rel, train = bundle.relevance, bundle.meta.get("train", {})
    if rel is None or train.get("selection") != "val":
        raise SystemExit(f"{args.model}: needs a relevance scale and a model trained with --selection val")
    parser = make_parser(bundle.text.cfg.parser)
    splits = {"validation part": held_out_split(load_split(args.data, "train"), int(train["val_images"]),
                                                int(train["val_seed"])),
              "dev": load_split(args.data, "dev")}
    rows: list[dict[str, Any]] = []
    for name, split in splits.items():
        data = load_split_data(args.data, split, bundle.image_cfg, args.cache, parser, args.workers)
        bundle.text.warm(data.parsed, data.sentences, args.cache / "vectors")
        matches = matches_of(data)
        scores = evaluate_scores(bundle, data)[1]
        n = scores.shape[0]
        rng = np.random.default_rng(args.seed)
        for size in (s for s in args.sizes if s <= n):
            found = []
            for _ in range(1 if size == n else args.draws):
                images = np.arange(n) if size == n else np.sort(rng.choice(n, size, replace=False))
                sents, pair = subset(data.pair_image, images)
                out, table = measure(rel, scores[np.ix_(images, sents)], matches[np.ix_(images, sents)], pair,
                                     np.zeros((size, 0)))
                found.append([np.nan if out[side][key] is None else float(out[side][key]) for side, key in MEASURES]
                             + [shown_relevance(table, side) for side in SIDES])
            mean = np.nanmean(np.asarray(found, dtype=np.float64), axis=0)  # none shown: no precision
            row: dict[str, Any] = {"split": name, "images": size, "draws": len(found)}
            names = [f"{side}_{key}" for side, key in MEASURES] + [f"{side}_relevance_at_cutoff" for side in SIDES]
            row.update({name: round(float(v), 4) for name, v in zip(names, mean, strict=True)})
            rows.append({**row, "machine": machine(), "command": command})
            logger.info("%s, %d images: %s", name, size, row)
    write_rows(args.out, list(rows[0]), rows)


if __name__ == "__main__":
    main()
