"""The backbone's arithmetic rate: multiply-adds per pass against CPU time per pass, on one thread.

    python -m bench.backbone_rate --passes 50

For each input side and runtime (torch eager, ONNX Runtime float, ONNX Runtime int8) one image is
passed ``--passes`` times through `Backbone.feature_map` after a warm-up, on one thread, and the
row reports the CPU milliseconds per pass, the wall milliseconds (median) and the implied rate in
GMAC/s: the multiply-adds of EfficientNet-Lite0's convolutions at that side (counted by hooks on
the torch model, the same graph the ONNX files are exported from) over the CPU time.

Whether a figure is plausible depends on the vector units: a core with two 256-bit FMA pipes
(AVX2) does 16 fp32 multiply-adds per cycle, one with two 512-bit pipes 32. The row records the
CPU's model, its reported clock and which of the relevant instruction sets it announces, so the
rate can be read against that core's peak. Writes docs/results/backbone-rate.csv.
"""

from __future__ import annotations

import argparse
import csv
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench import machine
from bench.extract_bench import BACKBONES, StageBackbone, stage_backbone
from fragsearch.model.onnx import set_threads
from fragsearch.model.resources import cpu_info

logger = logging.getLogger("bench.backbone_rate")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "backbone-rate.csv"
FIELDS = ("runtime", "precision", "side", "macs_m", "cpu_ms_per_pass", "wall_ms_median", "gmac_per_s",
          "cpu_mhz", "isa", "machine", "command")
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_vp2intersect")


def cpu_facts() -> tuple[float, str]:
    """(reported clock in MHz, the vector instruction sets announced)."""
    cpu = cpu_info()
    return cpu.mhz, " ".join(f for f in ISA_FLAGS if f in cpu.flags)


def conv_macs(side: int) -> int:
    """Multiply-adds of EfficientNet-Lite0's feature extractor for one side² image."""
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_name("efficientnet-lite0").eval()
    total = 0

    def count(m: torch.nn.Module, _inp: object, out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(m, torch.nn.Conv2d)
        total += out.numel() * m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)

    hooks = [m.register_forward_hook(count) for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.inference_mode():
        net.extract_features(torch.zeros(1, 3, side, side))
    for h in hooks:
        h.remove()
    return total


def time_passes(bb: StageBackbone, side: int, passes: int) -> tuple[float, float]:
    """(CPU ms per pass, median wall ms) of ``passes`` passes of one image after a warm-up."""
    x = (torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(0)) * 2 - 1).numpy()
    for _ in range(3):
        bb.feature_map(x)
    walls = []
    cpu = time.process_time()
    for _ in range(passes):
        start = time.perf_counter()
        bb.feature_map(x)
        walls.append(time.perf_counter() - start)
    return 1e3 * (time.process_time() - cpu) / passes, 1e3 * float(np.median(walls))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", type=int, nargs="+", default=[224, 448], help="input sides")
    ap.add_argument("--passes", type=int, default=50, help="timed passes per row")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    set_threads(1)
    mhz, isa = cpu_facts()
    command = "python -m bench.backbone_rate " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    rows = []
    macs = {side: conv_macs(side) for side in args.sides}
    for runtime, precision in BACKBONES:
        bb = stage_backbone(runtime, precision)
        for side in args.sides:
            cpu_ms, wall_ms = time_passes(bb, side, args.passes)
            rate = macs[side] / (cpu_ms * 1e-3) / 1e9
            logger.info("%-5s %-4s @%d: %.2f ms CPU per pass (median wall %.2f ms), %.1f M MACs -> %.1f GMAC/s",
                        runtime, precision, side, cpu_ms, wall_ms, macs[side] / 1e6, rate)
            rows.append((runtime, precision, side, round(macs[side] / 1e6, 1), round(cpu_ms, 2), round(wall_ms, 2),
                         round(rate, 1), round(mhz), isa, machine(), command))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        w.writerows(rows)
    logger.info("wrote %s (reported clock %.0f MHz; %s)", args.out, mhz, isa)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
