"""The runtime's matrix products on NumPy's BLAS and on ONNX Runtime side by side, by shape: what decides which
products model/product.py sends to ONNX Runtime (at most `THIN` columns, at least `LARGE` multiply-adds).

    python -m bench.product_shapes --out docs/results/product-shapes.csv

Each shape is a (rows x depth) float32 array times (depth x columns), random numbers, on `--threads` threads
(NumPy's BLAS and the ONNX Runtime session alike: a served request's share of the cores); the two ways are
timed in turn, `--repeats` times each, and the median kept. The rows of the search's scan and calibration
(20,000 = 1,000 images x 20 fragments, depth 512 or one block's 256), of a page's grounding (200) and of the
phrase evidence's references (6,000), against a query's 8-64 fragments, and the wide products of training and
evaluation (128, 512 columns).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench import machine, parse_run, write_rows
from bench.photo_decode import cpu_flags
from fragsearch.model import product
from fragsearch.model.onnx import limit_numeric_threads

logger = logging.getLogger("bench.product_shapes")

SHAPES = [(rows, depth, cols) for rows, depth in ((20_000, 512), (20_000, 256), (6_000, 512), (200, 512))
          for cols in (8, 16, 32, 64, 128, 512)]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return float(np.median(times))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the CSV written")
    ap.add_argument("--threads", type=int, default=1, help="threads of NumPy's BLAS and of the ONNX Runtime session")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs of each shape and way (the median is kept)")
    args, command = parse_run(ap, list(argv) if argv is not None else None, "bench.product_shapes")
    limit_numeric_threads(args.threads)
    session = product._session()
    rng = np.random.default_rng(0)
    rows = []
    for n, d, m in SHAPES:
        a = rng.standard_normal((n, d)).astype(np.float32)
        b = rng.standard_normal((d, m)).astype(np.float32)
        blas = median_ms(lambda a=a, b=b: a @ b, args.repeats)  # type: ignore[misc]
        ort = median_ms(lambda a=a, b=b: session.run(None, {"a": a, "b": b}), args.repeats)  # type: ignore[misc]
        served = "onnxruntime" if product.is_large(a, b.T) else "blas"
        logger.info("%6d x %3d by %3d: BLAS %7.2f ms, ONNX Runtime %7.2f ms (served: %s)", n, d, m, blas, ort, served)
        rows.append({"rows": n, "depth": d, "columns": m, "blas_ms": f"{blas:.3f}", "onnxruntime_ms": f"{ort:.3f}",
                     "ratio": f"{blas / ort:.2f}", "served_by": served, "threads": args.threads,
                     "machine": machine(), "cpu_flags": cpu_flags(), "command": command})
    write_rows(Path(args.out), list(rows[0]), rows)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
