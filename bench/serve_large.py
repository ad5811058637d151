"""Serving a large image index: cold start, the first query after a restart, memory, open files, load.

    python -m bench.serve_large --index artifacts/bench-1m/m1/index --model artifacts/models/full-val/model.pt

Starts the service (`python -m fragsearch.service`, loopback only, no preparation; its warm-up search before
it reports ready, as it runs by default, unless `--no-warmup`) on the index, with the index's files
first evicted from the page cache (posix_fadvise DONTNEED on each of
its files: the restart of a machine that has not read them since), and measures the seconds until
/readyz answers, the first /search/images (its store pages and candidate index paged in on
demand) and the second; the service's RSS (anonymous and file-backed apart) and open files after
each step; then `bench.load_bench --scenarios search --clients 1 8` against it (its rows to
`--load-out`). The results go to `--out` (JSON) with the command and the load averages.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import machine
from fragsearch.settings import default_artifacts_dir

logger = logging.getLogger("bench.serve_large")

READY_TIMEOUT_S = 600.0
QUERIES = ("a dog runs through the grass", "two children play on the beach")


def evict(folder: Path) -> int:
    """Drop the page-cache pages of every file in `folder` (bytes advised)."""
    total = 0
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += p.stat().st_size
            finally:
                os.close(fd)
    return total


def memory(pid: int) -> dict[str, Any]:
    """RSS (MB: total, anonymous, file-backed: psutil's shared) and open file descriptors of process `pid`."""
    proc = psutil.Process(pid)
    mem = proc.memory_info()
    return {"VmRSS_mb": round(mem.rss / 2**20, 1), "RssAnon_mb": round((mem.rss - mem.shared) / 2**20, 1),
            "RssFile_mb": round(mem.shared / 2**20, 1), "open_files": proc.num_fds()}


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    art = default_artifacts_dir()
    ap.add_argument("--index", type=Path, required=True, help="the image index served")
    ap.add_argument("--model", type=Path, default=art / "models" / "full-val" / "model.pt",
                    help="the model served")
    ap.add_argument("--port", type=int, default=8123, help="the loopback port the service listens on")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per client count of the load run")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrent clients of each load run")
    ap.add_argument("--threads", type=int, default=1, help="the service's threads (FRAGSEARCH_THREADS: its graphs)")
    ap.add_argument("--no-warmup", action="store_true", help="no warm-up search before ready (the first query "
                    "then loads the parser and the word vectors too)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/serve-large.json"),
                    help="the results JSON (start, memory)")
    ap.add_argument("--load-out", type=Path, default=Path("docs/results/service-load-large.csv"),
                    help="the load run's results CSV")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = f"http://127.0.0.1:{args.port}"
    result: dict[str, Any] = {"command": "python -m bench.serve_large " + shlex.join(sys.argv[1:] if argv is None
                                                                                      else argv),
                              "machine": machine(), "index": str(args.index)}
    result["evicted_bytes"] = evict(args.index)
    env = {**os.environ, "FRAGSEARCH_IMAGE_INDEX": str(args.index), "FRAGSEARCH_MODEL_PATH": str(args.model),
           "FRAGSEARCH_SENTENCE_INDEX": str(args.index.parent / "no-sentence-index"), "FRAGSEARCH_PREPARE": "false",
           "FRAGSEARCH_WARMUP": str(not args.no_warmup).lower(), "FRAGSEARCH_HOST": "127.0.0.1",
           "FRAGSEARCH_PORT": str(args.port), "FRAGSEARCH_THREADS": str(args.threads),
           "FRAGSEARCH_SEARCH_DEADLINE": "60"}
    result["load_average_start"] = load_average()
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "fragsearch.service"], env=env)
    try:
        with httpx.Client(base_url=url, timeout=120.0) as client:
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"the service exited with {server.returncode}")
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.perf_counter() - t0 > READY_TIMEOUT_S:
                    raise SystemExit("the service did not get ready")
                time.sleep(0.1)
            result["ready_s"] = round(time.perf_counter() - t0, 2)
            result["after_start"] = memory(server.pid)
            for n, sentence in enumerate(QUERIES):
                t1 = time.perf_counter()
                resp = client.post("/search/images", json={"sentence": sentence, "k": 10})
                resp.raise_for_status()
                result[f"query_{n + 1}_ms"] = round(1000 * (time.perf_counter() - t1), 1)
                result[f"query_{n + 1}_server_ms"] = resp.json().get("took_ms")
                result[f"after_query_{n + 1}"] = memory(server.pid)
            logger.info("ready in %.1f s; first query %.0f ms, second %.0f ms", result["ready_s"],
                        result["query_1_ms"], result["query_2_ms"])
        result["load_average_before_load"] = load_average()
        load = [sys.executable, "-m", "bench.load_bench", "--url", url, "--scenarios", "search", "--clients",
                *map(str, args.clients), "--duration", str(args.duration), "--pid", str(server.pid),
                "--out", str(args.load_out)]
        result["load_command"] = shlex.join(["python", *load[1:]])
        subprocess.run(load, check=False)
        result["load_average_after_load"] = load_average()
        result["after_load"] = memory(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    logger.info("wrote %s: %s", args.out, json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
