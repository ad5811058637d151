"""Image-fragment extraction throughput: roi_align vs crop region features, 1..k worker processes.

    python -m bench.extract_bench --data /work/shared/data/flickr8k --n 200 --workers 1 2

Runs on the first N images of train.txt without touching the feature cache and writes
docs/results/extract-bench.csv (method,images,workers,seconds,images_per_s,machine,command,
cpu_ms_per_image,load_avg). Besides the end-to-end rows it times the stages alone in one process
with one thread: selective search ("stage:proposals") and the backbone pass ("stage:backbone@<side>").
On a shared machine the wall-clock rows depend on the other load (load_avg, the 1-minute load
average before the run); cpu_ms_per_image (CPU time spent extracting, all workers) does much less,
and gives the estimate for idle cores: images/s ≈ cores * 1000 / cpu_ms_per_image.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench import machine
from model.cache import ExtractionPool
from model.config import ImageConfig, default_data_dir
from model.image import PROPOSAL_MODES, Backbone, load_image, propose_boxes, set_torch_threads

logger = logging.getLogger("bench.extract_bench")

FIELDS = ("method", "images", "workers", "seconds", "images_per_s", "machine", "command", "cpu_ms_per_image",
          "load_avg")
Row = tuple[str, int, int, float, float, float]  # label, images, workers, seconds, CPU seconds, load
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "extract-bench.csv"



def image_paths(data: Path, n: int, split: str = "train.txt") -> list[Path]:
    names = [ln.strip() for ln in (data / split).read_text().splitlines() if ln.strip()]
    return [data / "images" / name for name in names[:n]]


def time_stages(paths: Sequence[Path], cfg: ImageConfig, sides: Sequence[int]) -> list[Row]:
    """Per-stage timings for ``paths`` in this process with one thread."""
    set_torch_threads(1)
    images = [load_image(p) for p in paths]
    rows: list[Row] = []
    load, start, cpu = os.getloadavg()[0], time.perf_counter(), time.process_time()
    counts = [len(propose_boxes(np.asarray(img), cfg)) for img in images]
    rows.append((f"stage:proposals({cfg.proposal_mode}@{cfg.proposal_resize})", len(images), 1,
                 time.perf_counter() - start, time.process_time() - cpu, load))
    logger.info("selective search: %.1f proposals per image kept (max %d)", float(np.mean(counts)), cfg.max_proposals)
    backbone = Backbone("cpu")
    for side in sides:
        backbone.feature_map(torch.stack([backbone.preprocess(images[0], side)]))  # warm-up
        load, start, cpu = os.getloadavg()[0], time.perf_counter(), time.process_time()
        for i in range(0, len(images), 8):
            batch = torch.stack([backbone.preprocess(img, side) for img in images[i : i + 8]])
            backbone.feature_map(batch)
        rows.append((f"stage:backbone@{side}", len(images), 1, time.perf_counter() - start,
                     time.process_time() - cpu, load))
    return rows


def time_extraction(paths: Sequence[Path], cfg: ImageConfig, workers: int, batch: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) to extract ``paths`` with warm workers (start-up excluded)."""
    set_torch_threads(1)
    with ExtractionPool(cfg, "cpu", workers) as pool:
        start = time.perf_counter()
        pool.warm_up(paths[:2])
        logger.info("  %d worker(s) ready in %.1f s", workers, time.perf_counter() - start)
        pool.cpu_seconds = 0.0
        start = time.perf_counter()
        done, failed = pool.run(paths, batch=batch, progress=False)
        seconds = time.perf_counter() - start
    if failed:
        logger.warning("  %d images failed: %s", len(failed), failed[:3])
    return (seconds, pool.cpu_seconds) if done else (float("nan"), float("nan"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_dir())
    ap.add_argument("--n", type=int, default=200, help="images (the first N of train.txt)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--methods", nargs="+", default=["roi_align", "crop"], choices=["roi_align", "crop"])
    ap.add_argument("--backbone-sizes", type=int, nargs="+", default=[448, 224],
                    help="roi_align backbone sides to compare (crop runs with the first)")
    ap.add_argument("--proposal-mode", default=ImageConfig.proposal_mode, choices=PROPOSAL_MODES)
    ap.add_argument("--proposal-resize", type=int, default=ImageConfig.proposal_resize)
    ap.add_argument("--batch", type=int, default=8, help="images per task")
    ap.add_argument("--stage-images", type=int, default=50, help="images for the per-stage timings (0: skip)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--append", action="store_true", help="add rows to an existing CSV instead of replacing it")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")

    paths = image_paths(args.data, args.n)
    base = dataclasses.replace(ImageConfig(), proposal_mode=args.proposal_mode, proposal_resize=args.proposal_resize)
    command = "python -m bench.extract_bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    where = machine()
    logger.info("%d images from %s on %s", len(paths), args.data, where)

    rows: list[Row] = []
    if args.stage_images:
        for row in time_stages(paths[: args.stage_images], base, args.backbone_sizes):
            rows.append(row)
            label, n, _, seconds, cpu, _ = row
            logger.info("%-34s %6.1f images/s (1 thread; %.0f CPU ms/image)", label, n / seconds, 1000 * cpu / n)

    speed: dict[tuple[str, int], float] = {}
    cpu_ms: dict[str, float] = {}
    for method in args.methods:
        sides = args.backbone_sizes if method == "roi_align" else args.backbone_sizes[:1]
        for side in sides:
            cfg = dataclasses.replace(base, region_features=method, backbone_size=side)
            label = f"{method}@{side}" if method == "roi_align" else f"crop@{cfg.crop_size}(score@{side})"
            for workers in args.workers:
                load = os.getloadavg()[0]
                seconds, cpu = time_extraction(paths, cfg, workers, args.batch)
                rows.append((label, len(paths), workers, seconds, cpu, load))
                cpu_ms[label] = min(cpu_ms.get(label, float("inf")), 1000 * cpu / len(paths))
                if side == args.backbone_sizes[0]:
                    speed[(method, workers)] = len(paths) / seconds
                logger.info("%-34s %6.1f images/s with %d worker(s) (%.1f s; %.0f CPU ms/image; "
                            "load average before %.1f)", label, len(paths) / seconds, workers, seconds,
                            1000 * cpu / len(paths), load)

    for workers in args.workers:
        if ("roi_align", workers) in speed and ("crop", workers) in speed:
            logger.info("roi_align / crop speed ratio with %d worker(s): %.1fx",
                        workers, speed[("roi_align", workers)] / speed[("crop", workers)])
    for (method, workers), ips in sorted(speed.items()):
        logger.info("%s, %d worker(s): 7,000 images in %.1f min at the measured speed", method, workers,
                    7000 / ips / 60)
    cores = os.cpu_count() or 1
    for label, ms in cpu_ms.items():
        logger.info("%s on %d idle cores (CPU-bound estimate): %.1f images/s, 7,000 images in %.1f min",
                    label, cores, cores * 1000 / ms, 7000 * ms / cores / 60000)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    new = args.append and args.out.is_file()
    with args.out.open("a" if new else "w", newline="") as fh:
        writer = csv.writer(fh)
        if not new:
            writer.writerow(FIELDS)
        for label, n, workers, seconds, cpu, load in rows:
            writer.writerow([label, n, workers, f"{seconds:.2f}", f"{n / seconds:.2f}", where, command,
                             f"{1000 * cpu / n:.0f}", f"{load:.1f}"])
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
