"""The COCO detector's output on two instruction sets, side by side.

    python -m bench.detector_paths --images 3 --out docs/results/detector-paths.json

The detector (model/detector.py: SSD-MobileNet-v2 on OpenCV's DNN module, float) run on the first N dev
images natively and again under `qemu-x86_64 -cpu Haswell-v4` (user-mode emulation of an AVX2 + FMA CPU
without AVX-512 or VNNI, as bench/feature_paths.py does for the backbone). Compared: every prior's class
scores (the raw outputs), and the ranked detections (boxes, scores, classes) that become regions. Needs
`qemu-user`; skipped with a note without it. The JSON records the CPU's model and SIMD flags and the command.
"""

from __future__ import annotations

import argparse
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
from bench.feature_paths import EMULATED_CPU
from fragsearch.model.data import load_split
from fragsearch.model.detector import CANDIDATE_FLOOR, Detector
from fragsearch.model.resources import cpu_record
from fragsearch.settings import default_data_dir

logger = logging.getLogger("bench.detector_paths")


def dump(data: Path, n: int, out: Path) -> None:
    """Each image's raw class scores and its detections (score >= CANDIDATE_FLOOR) into an npz."""
    dev = load_split(data, "dev")
    detector = Detector()
    arrays: dict[str, np.ndarray] = {}
    for k, name in enumerate(dev.images[:n]):
        rgb = np.asarray(Image.open(dev.image_path(name)).convert("RGB"))
        boxes, scores = detector.raw(rgb)
        found = detector.detect(rgb, floor=CANDIDATE_FLOOR)
        arrays[f"raw_boxes{k}"], arrays[f"raw_scores{k}"] = boxes, scores
        arrays[f"boxes{k}"], arrays[f"scores{k}"], arrays[f"classes{k}"] = found.boxes, found.scores, found.classes
    np.savez(out, **arrays)  # type: ignore[arg-type]


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray], n: int) -> dict[str, Any]:
    same = {part: all(np.array_equal(a[f"{part}{k}"], b[f"{part}{k}"]) for k in range(n))
            for part in ("raw_boxes", "raw_scores", "boxes", "scores", "classes")}
    diff = max(float(np.abs(a[f"raw_scores{k}"] - b[f"raw_scores{k}"]).max()) for k in range(n))
    return {"images": n, "detections": int(sum(len(a[f"boxes{k}"]) for k in range(n))),
            **{f"{part}_equal": v for part, v in same.items()}, "raw_scores_max_abs_diff": diff}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=3, help="dev images compared")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--dump", type=Path, default=None, help=argparse.SUPPRESS)  # one side
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.dump is not None:
        dump(args.data, args.images, args.dump)
        return
    result: dict[str, Any] = {"command": "python -m bench.detector_paths " + shlex.join(sys.argv[1:] if argv is None
                                                                                         else argv),
                              "cpu": cpu_record()}
    qemu = shutil.which("qemu-x86_64")
    with tempfile.TemporaryDirectory(prefix="fragsearch-detector-") as tmp:
        native, emulated = Path(tmp) / "native.npz", Path(tmp) / "avx2.npz"
        t0 = time.perf_counter()
        dump(args.data, args.images, native)
        result["native_seconds"] = round(time.perf_counter() - t0, 1)
        if qemu is None:
            result["skipped"] = "qemu-x86_64 not installed (apt-get install qemu-user)"
        else:
            t0 = time.perf_counter()
            subprocess.run([qemu, "-cpu", EMULATED_CPU, sys.executable, "-m", "bench.detector_paths", "--dump",
                            str(emulated), "--images", str(args.images), "--data", str(args.data)],
                           check=True, stderr=subprocess.DEVNULL)
            result["emulated_seconds"] = round(time.perf_counter() - t0, 1)
            result["emulated_cpu"] = f"qemu-x86_64 -cpu {EMULATED_CPU} (AVX2, FMA; no AVX-512, no VNNI)"
            result.update(compare(dict(np.load(native)), dict(np.load(emulated)), args.images))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
