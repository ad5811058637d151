"""A query's stages on two checkouts side by side, in one run: the torch path (a checkout from before the
runtime, in an environment with torch) and this checkout's runtime (NumPy and ONNX Runtime).

    git worktree add /tmp/before 5909498             # the last commit that served through torch
    python -m bench.runtime_ab --before /tmp/before --before-python ~/.cache/fragsearch/venv-<torch>/bin/python \\
        --before-index /tmp/before/artifacts/index/images-dev --index artifacts/index/images-dev

Each side runs in a worker process of its own (its checkout, its environment, one thread), which loads its
released model and its image index and then times `bench.query_bench.run` (the stages a `/search/images`
query goes through: parse, word vectors, encoders, calibration scale, retrieval, response) for each query it
is sent. The queries go to the two workers in turn, so a busy machine slows both alike; the rows give each
side's median and p90 per stage and the ratio before / after, with the CPU's model and SIMD flags. Both
sides must rank alike: the top k images of every query (by file name: two indexes may number them apart)
are compared and the share that agree is written too.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench import machine
from fragsearch.model.data import load_split
from fragsearch.model.resources import cpu_info
from fragsearch.settings import default_artifacts_dir, default_data_dir

logger = logging.getLogger("bench.runtime_ab")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "results" / "query-stages-runtime.csv"
STAGES = ("parse", "word_vectors", "encoders", "calibration_scale", "retrieval", "response", "total")

# Runs inside each side's checkout and environment: loads the served model and the index, then answers one
# JSON line per query line (the stage milliseconds and the top ids). Written against what both checkouts have.
WORKER = r"""
import json, sys, time
threads = int(sys.argv[3])
try:
    from fragsearch.model.onnx import set_threads
except ImportError:
    set_threads = None
if set_threads is not None:
    set_threads(threads)
try:
    import torch
    torch.set_num_threads(threads)
except ImportError:
    pass
from bench.query_bench import run
from fragsearch.index.images import ImageIndex
from fragsearch.model.bundle import Bundle
from fragsearch.model.release import RELEASED_MODEL
bundle = Bundle.load(RELEASED_MODEL, device="cpu")
index = ImageIndex.load(sys.argv[1], bundle)
k = int(sys.argv[2])
print(json.dumps({"ready": True, "model": str(RELEASED_MODEL), "images": len(index)}), flush=True)
for line in sys.stdin:
    text = json.loads(line)
    times = run(bundle, index, [text], k)
    top = [h.name for h in index.search(text, k).hits]
    print(json.dumps({"ms": {s: v[0] for s, v in times.items()}, "top": top}), flush=True)
"""


class Side:
    """One checkout's worker process."""

    def __init__(self, name: str, checkout: Path, python: str, index: Path, k: int, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(checkout), "FRAGSEARCH_ARTIFACTS": str(index.parent.parent),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": str(threads)}
        self.name = name
        self.proc = subprocess.Popen([python, "-c", WORKER, str(index), str(k), str(threads)], cwd=checkout,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker stopped (exit {self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, text: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(text) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    art = default_artifacts_dir()
    ap.add_argument("--before", type=Path, required=True, help="a checkout that serves through torch")
    ap.add_argument("--before-python", required=True, help="the python of an environment with that checkout's lock")
    ap.add_argument("--before-index", type=Path, required=True, help="the dev-image index the before side built")
    ap.add_argument("--index", type=Path, default=art / "index" / "images-dev", help="this checkout's dev-image index")
    ap.add_argument("--python", default=sys.executable, help="the python of this checkout's environment")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--n", type=int, default=200, help="queries: the first N dev captions")
    ap.add_argument("--k", type=int, default=10, help="results per query")
    ap.add_argument("--threads", type=int, default=1, help="threads of each side's model")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    sentences, _ = load_split(args.data, "dev").sentences()
    sides = [Side("before", args.before.resolve(), args.before_python, args.before_index.resolve(), args.k,
                  args.threads),
             Side("after", ROOT, args.python, args.index.resolve(), args.k, args.threads)]
    for side in sides:
        logger.info("%s: %s", side.name, side.info)
        for text in sentences[-5:]:  # warm-up on other sentences
            side.ask(text)
    times = {s.name: {stage: [] for stage in STAGES} for s in sides}  # type: dict[str, dict[str, list[float]]]
    agree = 0
    queries = sentences[: args.n]
    for text in tqdm(queries, desc="queries", unit="query"):
        tops = []
        for side in sides:
            answer = side.ask(text)
            for stage in STAGES:
                times[side.name][stage].append(float(answer["ms"].get(stage, 0.0)))
            tops.append(answer["top"])
        agree += tops[0] == tops[1]
    for side in sides:
        side.close()
    command = "python -m bench.runtime_ab " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    flags = " ".join(f for f in ("avx512_vnni", "avx512f", "avx2") if f in cpu_info().flags)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["stage", "queries", "before_median_ms", "before_p90_ms", "after_median_ms", "after_p90_ms",
                    "ratio_median", "same_top_k", "threads", "machine", "cpu_flags", "command"])
        for stage in STAGES:
            b, a = (np.asarray(times[s][stage]) for s in ("before", "after"))
            ratio = float(np.median(b)) / max(float(np.median(a)), 1e-9)
            logger.info("%-18s before %7.2f ms  after %7.2f ms  (%.1fx)", stage, np.median(b), np.median(a), ratio)
            w.writerow([stage, len(queries), f"{np.median(b):.2f}", f"{np.percentile(b, 90):.2f}",
                        f"{np.median(a):.2f}", f"{np.percentile(a, 90):.2f}", f"{ratio:.2f}",
                        f"{agree / len(queries):.3f}", args.threads, machine(), flags, command])
    logger.info("top %d the same for %d of %d queries; wrote %s", args.k, agree, len(queries), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
