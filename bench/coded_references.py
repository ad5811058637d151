"""The references read through their 8-bit codes (model/product.py `QuantizedRows`) against the same references in
float32, side by side for one model:

    python -m bench.coded_references --out docs/results/coded-references.csv

A query's sentence scale is the spread of its S_kl against the calibration's reference images (20,000 fragments
for the released model): a scan per query beside the collection's. For each way: the milliseconds a query's
calibration scale takes (the first `--queries` dev captions, one thread, the two ways in turn per query), how far
each dev caption's scales
(one per block) move from the float32 ones (largest and mean relative difference), and the model's recall on dev
(its rankings: with several blocks a sentence's scales weigh the blocks, so a ranking can move).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench import machine, parse_run, write_rows
from bench.photo_decode import cpu_flags
from fragsearch.model import product
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import load_split_data
from fragsearch.model.onnx import limit_numeric_threads, set_threads
from fragsearch.model.score import block_slices
from fragsearch.settings import default_cache_dir, default_data_dir, default_model_path
from fragsearch.training.evaluate import evaluate

logger = logging.getLogger("bench.coded_references")
WAYS = ("codes", "float32")
METRICS = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10")


@contextmanager
def way(name: str) -> Iterator[None]:
    """The references read through their codes ("codes", as served) or in float32."""
    before = product.QUANTIZED
    product.QUANTIZED = name == "codes"
    try:
        yield
    finally:
        product.QUANTIZED = before


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path(), help="the model (default: the served one)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature and parse cache")
    ap.add_argument("--queries", type=int, default=200, help="dev captions timed one at a time")
    ap.add_argument("--workers", type=int, default=2, help="extraction processes for features not cached yet")
    ap.add_argument("--out", type=Path, default=Path("docs/results/coded-references.csv"), help="the CSV written")
    args, command = parse_run(ap, argv, "bench.coded_references")
    set_threads(1)
    limit_numeric_threads(1)
    bundle = Bundle.load(args.model)
    cal = bundle.calibration
    if cal is None:
        ap.error("the model is not calibrated: it has no references")
    cal = cal.numpy()
    dev = load_split_data(args.data, load_split(args.data, "dev"), bundle.image_cfg, args.cache, bundle.text.parser,
                          workers=args.workers)
    enc = bundle.text.encode_parsed(dev.parsed, dev.sentences)
    raw, mask = bundle.embed_sentences(enc, calibrated=False)
    scales: dict[str, np.ndarray] = {}
    recall: dict[str, dict[str, float]] = {}
    for name in WAYS:
        with way(name):
            calibrated = np.asarray(cal.calibrate_sentences(raw, mask, bundle.blocks))
            # each sentence's factor per block: a raw fragment's length over its calibrated one's
            first = mask.argmax(axis=1)
            rows = np.arange(len(raw))
            scales[name] = np.stack([np.linalg.norm(raw[rows, first, p], axis=1)
                                     / np.linalg.norm(calibrated[rows, first, p], axis=1)
                                     for p in block_slices(raw.shape[-1], bundle.blocks)], axis=1)
            recall[name] = evaluate(bundle, dev)
            logger.info("%s: dev R-sum %.2f", name, recall[name]["rsum"])
    times: dict[str, list[float]] = {n: [] for n in WAYS}
    for i in range(min(args.queries, len(raw))):
        for name in WAYS:
            with way(name):
                t0 = time.perf_counter()
                cal.calibrate_sentences(raw[i : i + 1], mask[i : i + 1], bundle.blocks)
                times[name].append(1000 * (time.perf_counter() - t0))
    ratio = scales["codes"] / scales["float32"] - 1.0
    rows_out: list[dict[str, object]] = []
    for name in WAYS:
        dev_ratio = ratio if name == "codes" else np.zeros_like(ratio)
        rows_out.append({
            "model": args.model.parent.name if args.model.suffix else args.model.name, "references": name,
            "scale_ms": round(float(np.median(times[name])), 2),
            "scale_p90_ms": round(float(np.percentile(times[name], 90)), 2),
            "queries": len(times[name]),
            "scale_max_rel_diff": f"{float(np.abs(dev_ratio).max()):.2e}",
            "scale_mean_rel_diff": f"{float(np.abs(dev_ratio).mean()):.2e}",
            "sentences": int(recall[name]["sentences"]),
            **{k: round(float(recall[name][k]), 2) for k in METRICS},
            "threads": 1, "machine": machine(), "cpu_flags": cpu_flags(), "command": command})
        logger.info("%s: scale %.2f ms", name, rows_out[-1]["scale_ms"])
    write_rows(args.out, list(rows_out[0]), rows_out)


if __name__ == "__main__":
    main()
