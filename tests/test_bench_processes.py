"""Process measurements of the benchmarks and the tests come from psutil, not from /proc read by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench import machine
from bench.bulk_bench import tree_cpu_seconds
from bench.load_bench import loadavg, proc_counts, proc_rss_mb

ROOT = Path(__file__).resolve().parent.parent
PROC = re.compile(r"""["']/{}(/[^"']*)?["']""".format("proc"))  # a /proc path in a string literal


def test_no_proc_path_is_read_by_hand_in_bench_and_tests() -> None:
    """Only /proc/cpuinfo is left to read (the CPU's name and instruction sets, which psutil does not
    give), and the page cache's drop switch to write (bench.million --cold)."""
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for package in ("bench", "tests")
             for p in sorted((ROOT / package).rglob("*.py")) for m in PROC.finditer(p.read_text())
             if m.group(1) not in ("/cpuinfo", "/sys/vm/drop_caches")]
    assert found == []


def test_the_cpu_seconds_of_a_live_child_are_counted() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\nprint(1, flush=True)\n" \
           "time.sleep(60)"
    before = tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"  # burnt, still alive
        assert tree_cpu_seconds() - before >= 0.55
    finally:
        child.kill()
        child.wait()


def test_memory_descriptors_and_threads_of_a_process() -> None:
    here = os.getpid()
    assert proc_rss_mb(here) > 10
    counts = proc_counts(here)
    assert counts["fds"] >= 3 and counts["threads"] >= 1
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    time.sleep(0.05)
    assert proc_counts(gone.pid) == {"fds": -1, "threads": -1} and proc_rss_mb(gone.pid) != proc_rss_mb(gone.pid)
    assert loadavg() >= 0 and machine().endswith(f" x {psutil.cpu_count(logical=True)} cores")


def test_the_load_bench_sends_distinct_files_of_the_same_picture() -> None:
    """Annotations under load must not be answered from the service's recent uploads: every file differs, every
    picture is the same."""
    import io

    from PIL import Image

    from bench.load_bench import Workload, upload_variants

    picture = Image.new("RGB", (64, 48), (10, 200, 30))
    work = Workload([], [], b"", variants=upload_variants(picture, 20))
    sent = [work.next_upload() for _ in range(20)]
    assert len(set(sent)) == 20
    assert len({Image.open(io.BytesIO(f)).convert("RGB").tobytes() for f in sent}) == 1  # one picture
