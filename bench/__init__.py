"""Benchmarks: each prints ratios measured side by side and writes its results under docs/results."""

from __future__ import annotations

import os
from pathlib import Path


def machine() -> str:
    """CPU model and logical core count, from /proc/cpuinfo."""
    model, cores = "unknown CPU", 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                cores += 1
    except OSError:
        pass
    return f"{model} x {cores or os.cpu_count()} cores"
