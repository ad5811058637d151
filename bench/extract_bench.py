"""Image-fragment extraction cost: per stage, and end to end for each image-feature variant.

    python -m bench.extract_bench --n 200 --workers 1 2 --variants full full-crop full-roi

Runs on the first N images of train.txt without touching the feature cache and writes
docs/results/extract-bench.csv (method,images,workers,seconds,images_per_s,machine,command,
cpu_ms_per_image,load_avg). Stage rows are timed in this process with one thread:

* ``stage:proposals(<mode>@<side>)``: selective search at each ``--proposal-resize``;
* ``stage:backbone@<side>[<runtime>,<precision>]``: one backbone pass per image (torch eager,
  ONNX Runtime float, ONNX Runtime int8);
* ``stage:crops20@<side>[<runtime>,<precision>]``: 20 region crops of an image warped to 224² and
  pooled (what the crop variants pay per image).

End-to-end rows (``<variant>``) run the variant's extractor over the N images with 1..k worker
processes. On a shared machine the wall-clock rows depend on the other load (load_avg, the 1-minute
load average before the run); cpu_ms_per_image (CPU time spent extracting, all workers) much less,
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
from PIL import Image

from bench import machine, made_backbone
from fragsearch.model.backbone import RUNTIMES, Backbone
from fragsearch.model.cache import ExtractionPool
from fragsearch.model.config import PROPOSAL_MODES, ImageConfig
from fragsearch.model.graphs import preprocess, to_array
from fragsearch.model.imageio import load_image
from fragsearch.model.onnx import set_threads
from fragsearch.model.proposals import propose_boxes
from fragsearch.model.variants import load_variant, variant_names
from fragsearch.settings import default_data_dir

if TYPE_CHECKING:
    from fragsearch.training.nets.backbone import TorchBackbone

logger = logging.getLogger("bench.extract_bench")

FIELDS = ("method", "images", "workers", "seconds", "images_per_s", "machine", "command", "cpu_ms_per_image",
          "load_avg")
Row = tuple[str, int, int, float, float, float]  # label, images, workers, seconds, CPU seconds, load
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "extract-bench.csv"
BACKBONES = (("torch", "fp32"), ("onnx", "fp32"), ("onnx", "int8"))  # (runtime, precision) of the stage rows
StageBackbone: TypeAlias = "Backbone | TorchBackbone"  # what a stage row times
CROPS_PER_IMAGE = 20


def image_paths(data: Path, n: int, split: str = "train.txt") -> list[Path]:
    names = [ln.strip() for ln in (data / split).read_text().splitlines() if ln.strip()]
    return [data / "images" / name for name in names[:n]]


def _timed(label: str, n: int, work: Callable[..., object], *args: object) -> Row:
    """One stage row: ``work(*args)`` timed in this process."""
    load, start, cpu = os.getloadavg()[0], time.perf_counter(), time.process_time()
    work(*args)
    return (label, n, 1, time.perf_counter() - start, time.process_time() - cpu, load)


def stage_backbone(runtime: str, precision: str) -> StageBackbone:
    """The backbone of a stage row on the CPU: torch eager (the trainer's, training/nets/backbone.py) or the
    runtime's graph on ONNX Runtime."""
    if runtime == "torch":
        from fragsearch.training.nets.backbone import TorchBackbone

        return TorchBackbone("cpu")
    return made_backbone(precision, runtime)


def _crops(img: Image.Image, rng: np.random.Generator, size: int = 224) -> np.ndarray:
    """CROPS_PER_IMAGE random boxes with sides >= 25 % of the image, warped to size²."""
    w, h = img.size
    out = []
    for _ in range(CROPS_PER_IMAGE):
        bw, bh = rng.uniform(0.25, 1.0) * w, rng.uniform(0.25, 1.0) * h
        x0, y0 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
        crop = img.resize((size, size), Image.Resampling.BILINEAR, box=(x0, y0, x0 + bw, y0 + bh))
        out.append(to_array(np.asarray(crop)))
    return np.stack(out)


def time_stages(paths: Sequence[Path], resizes: Sequence[int], sides: Sequence[int], mode: str) -> list[Row]:
    """Per-stage timings for ``paths`` in this process with one thread."""
    set_threads(1)
    images = [load_image(p) for p in paths]
    n = len(images)
    rows: list[Row] = []
    def proposals(cfg: ImageConfig, counts: list[int]) -> None:
        counts.extend(len(propose_boxes(np.asarray(im), cfg)) for im in images)

    def passes(bb: StageBackbone, side: int) -> None:
        for im in images:
            bb.feature_map(preprocess(im, side)[None])

    def crops(bb: StageBackbone, rng: np.random.Generator) -> None:
        for im in images:
            bb.pooled(_crops(im, rng))

    for resize in resizes:
        cfg = dataclasses.replace(ImageConfig(), proposal_mode=mode, proposal_resize=resize, min_box_frac=0.25)
        counts: list[int] = []
        rows.append(_timed(f"stage:proposals({mode}@{resize})", n, proposals, cfg, counts))
        logger.info("selective search @%d: %.1f proposals per image with sides >= 25 %%", resize, np.mean(counts))
    for runtime, precision in BACKBONES:
        bb = stage_backbone(runtime, precision)
        for side in sides:
            bb.feature_map(preprocess(images[0], side)[None])  # warm-up
            rows.append(_timed(f"stage:backbone@{side}[{runtime},{precision}]", n, passes, bb, side))
        rng = np.random.default_rng(0)
        bb.pooled(_crops(images[0], rng))
        rows.append(_timed(f"stage:crops{CROPS_PER_IMAGE}@224[{runtime},{precision}]", n, crops, bb, rng))
    return rows


def time_extraction(paths: Sequence[Path], cfg: ImageConfig, workers: int, batch: int,
                    runtime: str = "auto") -> tuple[float, float]:
    """(wall seconds, CPU seconds) to extract ``paths`` with warm workers (start-up excluded)."""
    set_threads(1)
    with ExtractionPool(cfg, "cpu", workers, runtime) as pool:
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
    ap.add_argument("--data", type=Path, default=default_data_dir(),
                    help="the Flickr8K folder (default: FRAGSEARCH_DATA or ../shared/data/flickr8k)")
    ap.add_argument("--n", type=int, default=200, help="images (the first N of train.txt)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker processes to compare")
    ap.add_argument("--variants", nargs="+", default=["full", "full-crop", "full-roi"], choices=variant_names(),
                    help="training variants whose image settings are run end to end")
    ap.add_argument("--runtimes", nargs="+", default=["auto"], choices=RUNTIMES,
                    help="backbone runtimes of the end-to-end rows (ONNX Runtime, labelled <variant>[onnx] when "
                         "named; torch eager has stage rows only)")
    ap.add_argument("--backbone-sizes", type=int, nargs="+", default=[224, 448],
                    help="sides of the backbone stage rows")
    ap.add_argument("--proposal-mode", default=ImageConfig.proposal_mode, choices=PROPOSAL_MODES,
                    help="selective search strategies of the proposals stage row")
    ap.add_argument("--proposal-resize", type=int, nargs="+", default=[224, 112], help="sides of the proposal rows")
    ap.add_argument("--batch", type=int, default=8, help="images per task")
    ap.add_argument("--stage-images", type=int, default=50, help="images for the per-stage timings (0: skip)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    ap.add_argument("--append", action="store_true", help="add rows to an existing CSV instead of replacing it")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")

    paths = image_paths(args.data, args.n)
    command = "python -m bench.extract_bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    where = machine()
    logger.info("%d images from %s on %s", len(paths), args.data, where)

    rows: list[Row] = []
    if args.stage_images:
        for row in time_stages(paths[: args.stage_images], args.proposal_resize, args.backbone_sizes,
                               args.proposal_mode):
            rows.append(row)
            label, n, _, seconds, cpu, _ = row
            logger.info("%-44s %7.1f images/s (1 thread; %.1f CPU ms/image)", label, n / seconds, 1000 * cpu / n)

    speed: dict[tuple[str, int], float] = {}
    cpu_ms: dict[str, float] = {}
    for variant in args.variants:
        cfg = load_variant(variant).image
        for runtime in args.runtimes:
            label = variant if runtime == "auto" else f"{variant}[{runtime}]"
            for workers in args.workers:
                load = os.getloadavg()[0]
                seconds, cpu = time_extraction(paths, cfg, workers, args.batch, runtime)
                rows.append((label, len(paths), workers, seconds, cpu, load))
                cpu_ms[label] = min(cpu_ms.get(label, float("inf")), 1000 * cpu / len(paths))
                speed[(label, workers)] = len(paths) / seconds
                logger.info("%-34s %6.1f images/s with %d worker(s) (%.1f s; %.0f CPU ms/image; load average "
                            "before %.1f)", label, len(paths) / seconds, workers, seconds, 1000 * cpu / len(paths),
                            load)

    for workers in args.workers:
        base = speed.get((args.variants[-1], workers))
        for variant in args.variants[:-1]:
            if base and (variant, workers) in speed:
                logger.info("%s / %s speed with %d worker(s): %.2fx", variant, args.variants[-1], workers,
                            speed[(variant, workers)] / base)
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
                             f"{1000 * cpu / n:.1f}", f"{load:.1f}"])
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
