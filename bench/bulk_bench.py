"""Bulk extraction speed: the Ray engine against the plain extractor (the feature cache's ExtractionPool),
side by side in one run, on the same images with the served model's image settings.

    python -m bench.bulk_bench --n 200 --workers 1 2

Each run starts from empty folders (a fresh feature cache and shard folder: nothing is a cache hit) and
is timed from the engine's start to its last shard: model loading in the workers / actors included,
Ray's own start (``ray.init`` on this machine, ``startup_s``) not — a cluster is up before a bulk job.
``workers`` is the number of extraction processes (local) or backbone actors (Ray, whose proposal stage
runs on one more logical CPU: ``index/bulk.py``). ``cpu_ms_per_image`` adds the CPU time of every
process of the run (this one, the pool's workers, Ray's daemons, tasks and actors): the cost that does
not depend on what else shares the machine. Rows go to docs/results/bulk-extract.csv.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import os
import resource
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from bench import machine
from bench.extract_bench import image_paths
from fragsearch.index.bulk import ENGINES, bulk_extract, ray_session
from fragsearch.model.cache import FeatureCache
from fragsearch.model.onnx import set_threads
from fragsearch.model.variants import load_variant, variant_names
from fragsearch.settings import default_data_dir

logger = logging.getLogger("bench.bulk_bench")

FIELDS = ("engine", "variant", "images", "workers", "seconds", "images_per_s", "cpu_ms_per_image", "startup_s",
          "failed", "machine", "command", "load_avg")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "bulk-extract.csv"


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process, its reaped children and every live
    descendant (Ray's daemons, tasks and actors; the local pool's workers), through psutil."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # ended meanwhile
            times = child.cpu_times()
            total += times.user + times.system
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--n", type=int, default=200, help="images (the first N of train.txt)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                    help="extraction processes (local) / backbone actors (ray) to compare")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES, help="engines to compare")
    ap.add_argument("--variant", default="full", choices=variant_names(), help="whose image settings are used")
    ap.add_argument("--batch", type=int, default=8, help="images per task / actor call")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")

    paths = image_paths(args.data, args.n)
    cfg = load_variant(args.variant).image
    command = "python -m bench.bulk_bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    where = machine()
    logger.info("%d images from %s on %s, %s image settings: %s", len(paths), args.data, where, args.variant, cfg)
    set_threads(1)
    rows: list[list[object]] = []
    speed: dict[tuple[str, int], float] = {}
    for workers in args.workers:
        for engine in args.engines:
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="fragsearch-bulk-bench-") as tmp:
                cache = FeatureCache(Path(tmp) / "cache", cfg)
                startup = 0.0
                if engine == "ray":
                    start = time.perf_counter()
                    with ray_session(None, workers):
                        startup = time.perf_counter() - start
                        cpu = tree_cpu_seconds()
                        report = bulk_extract(paths, Path(tmp) / "shards", cfg, engine, workers, None,
                                              batch=args.batch)
                        cpu = tree_cpu_seconds() - cpu  # before the shutdown ends Ray's processes
                else:
                    cpu = tree_cpu_seconds()
                    report = bulk_extract(paths, Path(tmp) / "shards", cfg, engine, workers, cache, batch=args.batch)
                    cpu = tree_cpu_seconds() - cpu
            cpu_ms = 1000 * cpu / max(1, report.extracted)
            speed[(engine, workers)] = report.images_per_s
            logger.info("%-5s %d worker(s): %6.2f images/s (%d images in %.1f s; %.0f CPU ms/image; start-up %.1f s; "
                        "load average before %.1f)", engine, workers, report.images_per_s, report.extracted,
                        report.seconds, cpu_ms, startup, load)
            rows.append([engine, args.variant, report.extracted, workers, f"{report.seconds:.2f}",
                         f"{report.images_per_s:.2f}", f"{cpu_ms:.1f}", f"{startup:.1f}", report.failed, where,
                         command, f"{load:.1f}"])
    for workers in args.workers:
        if ("ray", workers) in speed and ("local", workers) in speed and speed[("local", workers)] > 0:
            logger.info("ray / local with %d worker(s): %.2fx", workers,
                        speed[("ray", workers)] / speed[("local", workers)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(FIELDS)
        writer.writerows(rows)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
