"""The released model's image features through each path a machine may take, side by side.

    python -m bench.feature_paths --images 4 --rsum --out docs/results/feature-paths.json

Two parts:

1. **Instruction sets** (`--images N` dev images): the served extraction (proposals, then the int8 crops)
   run natively and again under `qemu-x86_64 -cpu Haswell-v4` (user-mode emulation of an AVX2 + FMA
   CPU without AVX-512 or VNNI: ONNX Runtime, OpenCV and numpy pick their AVX2 kernels there, as on
   such a laptop). Compared: the proposals, and the crops' features of the same boxes through the
   served int8 graph (7-bit weights), the 8-bit recipe it replaced, and the float graph. Needs
   `qemu-user` (Debian's package); skipped with a note without it.
2. **Dev R-sum** (`--rsum`): the released model evaluated on every dev image with features from the
   int8 graph (the served path) and from the float graph, on this machine.

The JSON records the CPU's model and SIMD flags and the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench import write_result
from fragsearch.model.backbone import backbone_graph
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import ImageConfig
from fragsearch.model.data import load_split
from fragsearch.model.dataset import load_split_data
from fragsearch.model.image import RegionExtractor, image_proposals, region_crops
from fragsearch.model.onnx import session, set_threads
from fragsearch.model.parsers import make_parser
from fragsearch.model.places import Places
from fragsearch.model.release import RELEASED_MODEL
from fragsearch.model.resources import cpu_record
from fragsearch.settings import default_cache_dir, default_data_dir, default_places
from fragsearch.training.evaluate import evaluate
from fragsearch.training.graphs import make_graphs

logger = logging.getLogger(__name__)

EMULATED_CPU = "Haswell-v4"  # AVX2, FMA, F16C; no AVX-512, no VNNI


def graphs(places: Places) -> dict[str, Path]:
    """The three backbone graphs compared: the served int8 (7-bit weights), the 8-bit recipe, the float (the
    release's where it ships them, else the graph folder's of `places`; a missing one is made there by the torch
    side)."""
    for precision in ("fp32", "int8"):  # the export step where the graph folder lacks them
        make_graphs(ImageConfig(backbone_precision=precision), places)
    fp32 = backbone_graph("fp32", places=places)
    int8 = backbone_graph("int8", places=places)
    folder = places.graphs
    bits8 = folder / "efficientnet-lite0-int8-8bit-bench.onnx"
    if not bits8.is_file():
        from fragsearch.training.nets.backbone import _quantize  # the quantization recipe's maker (the trainer's side)

        folder.mkdir(parents=True, exist_ok=True)
        _quantize(fp32, bits8, reduce_range=False)
    return {"int8-7bit": int8, "int8-8bit": bits8, "fp32": fp32}


def dump(paths: list[Path], places: Places, boxes_from: Path | None, out: Path) -> None:
    """Proposals of each image and the pooled features of its crops through each graph (the crops of
    `boxes_from`'s boxes when given, so that two machines compare the same crops) into an npz."""
    bundle_cfg = Bundle.load(RELEASED_MODEL).image_cfg
    extractor = RegionExtractor(bundle_cfg, places=places)  # the served extraction
    given = np.load(boxes_from) if boxes_from is not None else None
    arrays: dict[str, np.ndarray] = {}
    sessions = {name: session(path) for name, path in graphs(places).items()}
    for k, path in enumerate(paths):
        img = Image.open(path).convert("RGB")
        arrays[f"proposals{k}"] = image_proposals(img, bundle_cfg)
        own = extractor.extract(img).boxes
        arrays[f"boxes{k}"] = own
        boxes = given[f"boxes{k}"] if given is not None else own
        crops = region_crops(img, boxes, bundle_cfg.crop_size)
        for name, sess in sessions.items():
            feats = [sess.run(None, {"x": crops[i : i + 1]})[0].mean(axis=(2, 3)) for i in range(len(crops))]
            arrays[f"{name}{k}"] = np.concatenate(feats)
    np.savez(out, **arrays)  # type: ignore[arg-type]


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray], n: int) -> dict[str, Any]:
    """Per graph: the share of feature values equal bit for bit, the largest absolute difference, the lowest
    cosine between a crop's two feature vectors; and whether the proposals and kept boxes are equal."""
    out: dict[str, Any] = {"images": n,
                           "proposals_equal": all(np.array_equal(a[f"proposals{k}"], b[f"proposals{k}"], equal_nan=True)
                                                  for k in range(n)),
                           "boxes_equal": all(np.array_equal(a[f"boxes{k}"], b[f"boxes{k}"]) for k in range(n))}
    for name in ("int8-7bit", "int8-8bit", "fp32"):
        x = np.concatenate([a[f"{name}{k}"] for k in range(n)]).astype(np.float64)
        y = np.concatenate([b[f"{name}{k}"] for k in range(n)]).astype(np.float64)
        cos = (x * y).sum(1) / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-12)
        out[name] = {"crops": len(x), "equal_share": float(np.mean(x == y)),
                     "max_abs_diff": float(np.abs(x - y).max()), "min_cosine": float(cos.min()),
                     "max_abs_value": float(np.abs(x).max())}
    return out


def instruction_sets(data: Path, n: int, places: Places) -> dict[str, Any]:
    qemu = shutil.which("qemu-x86_64")
    dev = load_split(data, "dev")
    paths = [dev.image_path(name) for name in dev.images[:n]]
    with tempfile.TemporaryDirectory(prefix="fragsearch-paths-") as tmp:
        native = Path(tmp) / "native.npz"
        t0 = time.perf_counter()
        dump(paths, places, None, native)
        native_s = time.perf_counter() - t0
        if qemu is None:
            return {"skipped": "qemu-x86_64 not installed (apt-get install qemu-user)"}
        emulated = Path(tmp) / "avx2.npz"
        cmd = [qemu, "-cpu", EMULATED_CPU, sys.executable, "-m", "bench.feature_paths", "--dump", str(emulated),
               "--boxes", str(native), "--images", str(n), "--data", str(data), "--cache", str(places.cache)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
        emulated_s = time.perf_counter() - t0
        result = compare(dict(np.load(native)), dict(np.load(emulated)), n)
    result.update(emulated_cpu=f"qemu-x86_64 -cpu {EMULATED_CPU} (AVX2, FMA; no AVX-512, no VNNI)",
                  native_seconds=round(native_s, 1), emulated_seconds=round(emulated_s, 1))
    return result


def dev_rsum(data: Path, cache: Path, workers: int) -> list[dict[str, Any]]:
    bundle = Bundle.load(RELEASED_MODEL)
    rows = []
    for precision in ("int8", "fp32"):
        cfg = dataclasses.replace(bundle.image_cfg, backbone_precision=precision)
        t0 = time.perf_counter()
        split = load_split_data(data, "dev", cfg, cache, make_parser(bundle.text.cfg.parser), workers=workers)
        seconds = time.perf_counter() - t0
        m = evaluate(bundle, split)
        rows.append({"features": f"{precision} graph" + (" (served)" if precision == bundle.image_cfg.backbone_precision
                                                         else ""),
                     "rsum": round(m["rsum"], 2), "annot_r1": round(m["annot_r1"], 2),
                     "search_r1": round(m["search_r1"], 2), "extract_seconds_if_uncached": round(seconds, 1)})
        logger.info("dev through %s features: R-sum %.2f", precision, m["rsum"])
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4, help="dev images compared across instruction sets")
    ap.add_argument("--rsum", action="store_true", help="also the dev R-sum through the int8 and float graphs")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature cache")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes (--rsum)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--dump", type=Path, default=None, help=argparse.SUPPRESS)  # one side of part 1
    ap.add_argument("--boxes", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_threads(1)
    places = default_places(args.cache)
    if args.dump is not None:
        dev = load_split(args.data, "dev")
        dump([dev.image_path(n) for n in dev.images[: args.images]], places, args.boxes, args.dump)
        return
    result: dict[str, Any] = {"command": "python -m bench.feature_paths " + shlex.join(sys.argv[1:] if argv is None
                                                                                        else argv),
                              "cpu": cpu_record(), "model": str(RELEASED_MODEL.relative_to(RELEASED_MODEL.parents[2])),
                              "instruction_sets": instruction_sets(args.data, args.images, places)}
    if args.rsum:
        result["dev"] = dev_rsum(args.data, args.cache, args.workers)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
