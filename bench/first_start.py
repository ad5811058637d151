"""The first `./run serve` of a fresh clone, end to end, with its stage table.

    python -m bench.first_start --out docs/results/first-start.json [--home /tmp/empty-home] [--port 8765]

Clones the checkout's HEAD into a temporary folder and runs `./run serve` there with an empty HOME (so
the Python environment is made from nothing: ~/.cache/fragsearch is in it) on 127.0.0.1, the data set
read from its usual place; each line the command prints is stamped with the seconds since the launch,
/readyz is polled every second until it answers 200, then the service is stopped. The stages are read
from the stamped lines: the environment (until Python's first line), the model, the image index, the
sentence index and loading, as the service logs them. The JSON records the CPU's model and SIMD flags,
the commit and the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from fragsearch.model.resources import cpu_record
from fragsearch.settings import default_data_dir
from fragsearch.training.release import ROOT, git_commit

logger = logging.getLogger(__name__)

# (stage, the text of the log line that starts it)
MARKS = (("model", "preparing: model"), ("image index", "preparing: image index"),
         ("sentence index", "preparing: sentence index"), ("loading", "preparing: loading"))


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def tree_rss_mb(pid: int) -> float:
    """The resident memory of a process and its children (the extraction workers), in MB (psutil)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total / 1e6


def du_mb(folder: Path, exclude: tuple[str, ...] = ()) -> float:
    """The size of the files under `folder` (top-level names in `exclude` left out), in MB."""
    total = 0
    for root, dirs, files in os.walk(folder):
        if Path(root) == folder:
            dirs[:] = [d for d in dirs if d not in exclude]
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                total += path.stat().st_size
    return round(total / 1e6, 1)


def first_start(clone: Path, home: Path, port: int, data: Path, limit_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAGSEARCH_")}
    env.update(HOME=str(home), FRAGSEARCH_DATA=str(data), FRAGSEARCH_PORT=str(port))
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(["./run", "serve"], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready_at = None
    ready_rss_mb = 0.0
    peak_rss_mb = 0.0  # sampled every second: the service and its extraction workers together
    try:
        while time.monotonic() - t0 < limit_s and proc.poll() is None:
            peak_rss_mb = max(peak_rss_mb, tree_rss_mb(proc.pid))  # ./run execs python: the same process
            if ready(port):
                ready_at = time.monotonic() - t0
                time.sleep(5.0)  # the preparation's workers gone: what the service holds while it serves
                ready_rss_mb = tree_rss_mb(proc.pid)
                break
            time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    if ready_at is None:
        tail = "\n".join(text for _, text in lines[-20:])
        raise RuntimeError(f"not ready within {limit_s:.0f} s (exit {proc.returncode}):\n{tail}")
    python_at = next((t for t, text in lines if " INFO " in text or text.startswith("{")), None)
    # the stages in the order the preparation enters them ("preparing: <stage> (<detail>)"), each until the next;
    # the service loads the image index for searches while the sentence index is built (in the preparation's
    # child process): that loading is when searches are served, not a stage of the chain
    marks = [(text.split("preparing: ", 1)[1], t) for t, text in lines if "service.prepare: preparing: " in text]
    searches_at = next((at for name, at in marks if name.startswith("loading") and "searches" in name), None)
    starts = [("environment", 0.0)] + ([("python start-up", python_at)] if python_at is not None else [])
    starts += [(name, at) for name, at in marks if not (name.startswith("loading") and "searches" in name)]
    stages = [{"stage": name, "start_s": round(at, 1),
               "seconds": round((starts[i + 1][1] if i + 1 < len(starts) else ready_at) - at, 1)}
              for i, (name, at) in enumerate(starts)]
    sizes = {"environment_mb": du_mb(home / ".cache" / "fragsearch"), "artifacts_mb": du_mb(clone / "artifacts"),
             "checkout_mb": du_mb(clone, exclude=("artifacts",))}
    kept = ("setting up", "fragsearch.service.prepare", "fragsearch.model.cache", "fragsearch.index.build",
            "fragsearch.model.fragments", "service:")
    return {"ready_seconds": round(ready_at, 1),
            "searches_served_seconds": None if searches_at is None else round(searches_at, 1),
            "stages": stages, "peak_rss_mb": round(peak_rss_mb, 1),
            "ready_rss_mb": round(ready_rss_mb, 1), "disk": sizes, **git_commit(clone),
            "log": [f"{t:7.1f}s {text}" for t, text in lines if any(k in text for k in kept)][:120]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="write the results as JSON here")
    ap.add_argument("--home", type=Path, default=None, help="the empty HOME (default: a new temporary folder)")
    ap.add_argument("--port", type=int, default=8765, help="the loopback port the service listens on")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--limit", type=float, default=3600.0, help="seconds to wait for /readyz")
    ap.add_argument("--keep-artifacts", type=Path, default=None,
                    help="move the clone's artifacts/ (features, indexes) here afterwards, for later benchmarks")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="fragsearch-first-start-") as tmp:
        clone = Path(tmp) / "fragsearch"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        home = args.home or Path(tmp) / "home"
        home.mkdir(parents=True, exist_ok=True)
        if any(home.iterdir()):
            ap.error(f"{home} is not empty: the first start is measured from an empty HOME")
        result = first_start(clone, home, args.port, args.data.resolve(), args.limit)
        if args.keep_artifacts is not None:
            shutil.rmtree(args.keep_artifacts, ignore_errors=True)
            shutil.move(str(clone / "artifacts"), str(args.keep_artifacts))
    result = {"command": "python -m bench.first_start " + shlex.join(sys.argv[1:] if argv is None else argv),
              "cpu": cpu_record(), "cores": os.cpu_count(), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for s in result["stages"]:
        logger.info("%7.1f s  %s", s["seconds"], s["stage"])
    logger.info("ready after %.1f s (%.1f min)", result["ready_seconds"], result["ready_seconds"] / 60)


if __name__ == "__main__":
    main()
