"""The server's numeric threads (model/onnx.py): each request running at once gets its share of the CPUs for
NumPy's products and FAISS, set once when `python -m fragsearch.service` starts (`numeric_threads` overrides it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fragsearch.model.onnx import request_threads

ROOT = Path(__file__).resolve().parent.parent


def test_each_running_request_gets_its_share_of_the_cpus() -> None:
    assert request_threads(4, cpus=2) == 1
    assert request_threads(4, cpus=16) == 4
    assert request_threads(2, cpus=3) == 1
    assert request_threads(1, cpus=8) == 8
    assert request_threads(0, cpus=8) == 8


def test_the_limit_reaches_numpys_blas_and_faiss() -> None:
    """In a process of its own (the limit is the process's from then on): NumPy's BLAS and the OpenMP pool FAISS
    loads run one thread each."""
    code = ("import json, numpy, faiss; from fragsearch.model.onnx import limit_numeric_threads; "
            "print(json.dumps(limit_numeric_threads(1)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=120)
    limits = json.loads(out.stdout.strip().splitlines()[-1])
    assert limits.get("blas") == 1, limits
    assert set(limits.values()) == {1}, limits
