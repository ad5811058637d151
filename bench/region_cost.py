"""What an image's fragments cost with each source of regions, side by side in one run.

    python -m bench.region_cost --images 60 --out docs/results/region-cost.csv
    PYTHONPATH=/tmp/lite12 python -m bench.region_cost --backbones efficientnet-lite0 efficientnet-lite1
    python -m bench.region_cost --images 60 --also artifacts/models/released-regions \
        --out docs/results/region-ranker-cost.csv

For the first N dev images, the served extraction of the released model's settings (int8 crops) with
``proposals`` = selective search (ranked by the ImageNet Lite0), the COCO detector, and the detector topped
up with selective search, for each crop backbone of ``--backbones`` (the model's own at the model's crop
side, another at its native input side; the model's own by default; Lite1 / Lite2 need their weight
packages on the path, model/backbone.py): one thread, one image at a time, the extractors interleaved image
by image so that the machine's load falls on all of them alike. Measured per image: the CPU time of this
process (the cost a core pays) and the wall time; reported as medians and p90, and as ratios to selective
search with the first backbone. ``--also`` measures other models' own extraction beside them (e.g. the same
selective search ordered by a region ranker, model/regions.py); the ``ranking`` column says how each orders its
proposals. The CSV records the CPU's model and SIMD flags and the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench import machine, made_extractor, parse_run, write_rows
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import BACKBONE_NAMES, PROPOSAL_SOURCES
from fragsearch.model.data import load_split
from fragsearch.model.graphs import BACKBONES
from fragsearch.model.onnx import set_threads
from fragsearch.model.release import RELEASED_MODEL
from fragsearch.model.resources import cpu_info
from fragsearch.settings import default_data_dir

logger = logging.getLogger("bench.region_cost")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "region-cost.csv"
COLUMNS = ["proposals", "backbone", "ranking", "images", "cpu_ms_median", "cpu_ms_p90", "wall_ms_median", "cpu_ratio",
           "threads", "machine", "simd", "command"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--images", type=int, default=60, help="the first N dev images")
    ap.add_argument("--model", type=Path, default=RELEASED_MODEL, help="the model whose image settings are used")
    ap.add_argument("--backbones", nargs="+", choices=BACKBONE_NAMES, default=None,
                    help="the crop backbones measured (default: the model's)")
    ap.add_argument("--also", type=Path, nargs="*", default=[],
                    help="other models whose own extraction (their image settings as they are) is measured beside")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    args, command = parse_run(ap, argv, "bench.region_cost")
    set_threads(1)
    base = Bundle.load(args.model).image_cfg
    backbones = args.backbones or [base.backbone]
    # the model's own backbone at the model's crop side, another at its native side
    extractors = {(src, name, base.region_ranker): made_extractor(dataclasses.replace(
        base, proposals=src, backbone=name, crop_size=base.crop_size if name == base.backbone else BACKBONES[name][2]))
        for name in backbones for src in PROPOSAL_SOURCES}
    for other in args.also:
        cfg = Bundle.load(other).image_cfg
        extractors[cfg.proposals, cfg.backbone, cfg.region_ranker] = made_extractor(cfg)
    dev = load_split(args.data, "dev")
    images = [Image.open(dev.image_path(n)).convert("RGB") for n in dev.images[: args.images]]
    for ex in extractors.values():  # warm: graphs loaded, first-call allocations done
        ex.extract(images[0])
    cpu: dict[tuple[str, str, str], list[float]] = {s: [] for s in extractors}
    wall: dict[tuple[str, str, str], list[float]] = {s: [] for s in extractors}
    for k, img in enumerate(images):
        order = list(extractors) if k % 2 == 0 else list(reversed(extractors))
        for key in order:
            c0, w0 = time.process_time(), time.perf_counter()
            extractors[key].extract(img)
            cpu[key].append((time.process_time() - c0) * 1000)
            wall[key].append((time.perf_counter() - w0) * 1000)
    base_cpu = float(np.median(cpu["selective_search", backbones[0], base.region_ranker]))
    flags = " ".join(sorted(f for f in cpu_info().flags if f.startswith(("avx", "fma"))))
    rows: list[dict[str, object]] = []
    for key in extractors:
        src, name, ranker = key
        med = float(np.median(cpu[key]))
        rows.append({"proposals": src, "backbone": name, "ranking": ranker or "imagenet head",
                     "images": len(images), "cpu_ms_median": round(med, 1),
                     "cpu_ms_p90": round(float(np.percentile(cpu[key], 90)), 1),
                     "wall_ms_median": round(float(np.median(wall[key])), 1),
                     "cpu_ratio": round(med / base_cpu, 2), "threads": 1, "machine": machine(), "simd": flags,
                     "command": command})
        logger.info("%s, %s, %s: %.1f ms CPU per image (median), %.2fx the first backbone's selective search", src,
                    name, ranker or "imagenet head", med, med / base_cpu)
    write_rows(args.out, COLUMNS, rows)


if __name__ == "__main__":
    main()
