"""tools/image_check.py, the image build's check of what it installed, run here in the development environment:
it passes what the development lock pins (torch included: that lock pins it) and fails, naming them, on the
training stack where only the runtime lock is given, and on a CPU build of ONNX Runtime or FAISS for the gpu
variant. (The gpu variant's passing run needs onnxruntime-gpu and faiss-gpu-cuvs installed: only the image
build has them.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import image_check

ROOT = Path(__file__).resolve().parent.parent
RUNTIME, DEV = ROOT / "requirements.lock", ROOT / "requirements-dev.lock"


def test_the_training_stack_is_found_where_only_the_runtime_lock_was_installed() -> None:
    want = image_check.expected([RUNTIME], "cpu")
    problems = image_check.check_installed(want, image_check.installed())
    for name in ("torch", "torchvision", "transformers", "sentence-transformers", "scikit-learn", "onnx"):
        assert any(p.startswith(f"{name} ") and "(of the training stack)" in p for p in problems), name
    assert any(p.startswith("nvidia-cudnn-cu13 ") and "(a CUDA library)" in p for p in problems)
    assert any(p.startswith("pytest ") and "(not pinned)" in p for p in problems)
    assert image_check.check_imports(want) == ["torch is importable"]


def test_what_the_development_lock_pins_passes() -> None:
    want = image_check.expected([DEV], "cpu")
    assert image_check.check_installed(want, image_check.installed()) == []
    assert image_check.check_imports(want) == []  # torch importable: that lock pins it


def test_a_version_other_than_the_locks_and_a_missing_pin_are_named() -> None:
    want = {"numpy": "2.4.6", "faiss-cpu": "1.15.1"}
    have = {"numpy": "2.4.5", "pip": "23.0.1"}  # pip: the venv's own, never pinned
    assert image_check.check_installed(want, have) == ["numpy 2.4.5 is installed, the locks pin 2.4.6",
                                                       "faiss-cpu==1.15.1 is pinned but not installed"]


def test_the_gpu_variant_expects_the_gpu_extra_for_onnxruntime_and_faiss_cpu() -> None:
    cpu, gpu = image_check.expected([RUNTIME], "cpu"), image_check.expected([RUNTIME], "gpu")
    assert {"onnxruntime", "faiss-cpu"} <= set(cpu) and not {"onnxruntime", "faiss-cpu"} & set(gpu)
    assert gpu["onnxruntime-gpu"] == cpu["onnxruntime"] and gpu["faiss-gpu-cuvs"] == cpu["faiss-cpu"]
    assert set(gpu) - set(cpu) == set(image_check.gpu_pins())
    problems = image_check.check_installed(gpu, {**gpu, "onnxruntime": cpu["onnxruntime"]})
    assert problems == [f"onnxruntime {cpu['onnxruntime']} is installed (not pinned): no lock the image installs "
                        "pins it"]


def test_a_lock_that_disagrees_with_another_stops_the_check(tmp_path: Path) -> None:
    other = tmp_path / "requirements-x.lock"
    other.write_text("numpy==1.0.0\n    # via x\n")
    with pytest.raises(ValueError, match="numpy==1.0.0"):
        image_check.expected([RUNTIME, other], "cpu")


def test_requirements_are_met_but_the_file_packages_own() -> None:
    """What pip check reports here is the file package's sentence-transformers only where it is missing; in this
    environment (the development lock) everything is met, and the check finds nothing."""
    assert image_check.check_requirements(image_check.installed(), "cpu") == []


def test_a_missing_requirement_is_named() -> None:
    have = image_check.installed()
    del have["packaging"]  # required by onnxruntime, faiss-cpu, spaCy, ...
    problems = image_check.check_requirements(have, "cpu")
    assert any(p.startswith("onnxruntime requires packaging") and "not installed" in p for p in problems), problems


def test_the_gpu_variant_refuses_a_cpu_build_of_onnxruntime() -> None:
    (problem,) = image_check.check_providers("gpu")
    assert "has no CUDAExecutionProvider" in problem
    assert image_check.check_providers("cpu") == []


def test_the_command_passes_in_this_environment_with_its_lock_and_loads_the_released_model() -> None:
    r = subprocess.run([sys.executable, "-m", "tools.image_check", "--variant", "cpu", "--locks", str(DEV)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for step in ("installed", "requirements", "imports", "providers", "released model"):
        assert f"{step}: ok" in r.stdout
    assert "backbone on CPUExecutionProvider, MiniLM on CPUExecutionProvider" in r.stdout

