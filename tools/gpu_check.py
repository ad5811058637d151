"""The GPU check: one command for a GPU machine that has no package registry, writing a JSON report.

    tools/gpu-check                      on the GPU (cuda), every core; the report: $OUT/gpu-check.json
    tools/gpu-check --dry-run            the same stages on the CPU (GPU_CHECK_DEVICE=cpu), fewer images
    tools/gpu-check --build-wheels       here: the wheels the check needs, into artifacts/gpu-wheels

Stages, each recorded with its seconds, its outcome and what it measured:

1. `environment`: torch and its CUDA, the GPU, its compute capability and the kernels torch carries
   (`torch.cuda.get_arch_list()`) for training; for the served path ONNX Runtime's providers and the one a
   session of the served backbone graph gets on the device (on a GPU it must be onnxruntime-gpu's CUDA
   provider, not a fall-back to the CPU's), faiss (and whether it has a GPU); the cores.
2. `tests`: on the device, through pytest (its JUnit report read back per test): tests/test_gpu.py (marked
   gpu), tests/test_gpu_check.py (the service's ranked routes on the device against the CPU, its graphs on
   the device's provider; one training epoch and the calibration on the device), tests/test_device_mixing.py (with
   `-p tests.real_device` on a GPU: every path on CUDA against the CPU) and tests/test_extraction_device.py;
   the dry run the second and the last.
3. `first start`: `python -m fragsearch.service.prepare` with the released model on the first `--images` images of
   the data folder's dev split and as many training captions (FRAGSEARCH_LIMIT), `--workers` extraction
   processes, then the service loaded and one search answered; its stages' times from its log, and on a
   GPU the processes that held a CUDA context meanwhile (nvidia-smi): the extraction workers must not.

The Python that runs it needs torch (the trainer's, a CUDA build), numpy, onnxruntime (onnxruntime-gpu on a
GPU: the served graphs run on its CUDA provider) and opencv; everything else the project needs
comes from the wheelhouse (`--wheels`, made here by `--build-wheels` with pip download), installed with
--no-index into a venv with --system-site-packages (`tools/gpu-check` does that before it runs this).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("tools.gpu_check")

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "artifacts" / "gpu-wheels"
WHEELS_MAX_BYTES = 60 * 2**20
# on the GPU machine already (and what they bring): never carried
PRESENT = re.compile(r"^(torch|torchvision|numpy|onnxruntime|opencv-[a-z-]+|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|triton"
                     r"|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec|typing-extensions|setuptools"
                     r"|flatbuffers|protobuf|coloredlogs|humanfriendly)$")
EXTRA = ("pytest", "iniconfig", "pluggy", "torchvision")  # for the tests; torchvision if the machine lacks it
TRAINER_LOCK = "requirements-train.lock"  # the runtime lock with the trainer's torch side (tools/lock.py)
TESTS = ("tests/test_gpu.py", "tests/test_gpu_check.py", "tests/test_device_mixing.py",
         "tests/test_extraction_device.py")
# the dry run: the device's own tests on the CPU (tests/test_gpu.py skips there, and
# tests/test_device_mixing.py runs its stand-in device in the suite already)
DRY_RUN_TESTS = ("tests/test_gpu_check.py", "tests/test_extraction_device.py")


def _run(cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """subprocess.run in a session of its own: on a timeout the whole group is killed (prepare's extraction
    workers with it), then TimeoutExpired is raised."""
    with subprocess.Popen(cmd, start_new_session=True, text=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@dataclass
class Stage:
    name: str
    ok: bool = False
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _pins(lock: Path) -> dict[str, str]:
    out = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def wheel_requirements() -> list[str]:
    """The pinned requirements the wheelhouse holds: the trainer's lock (the runtime and the `train` extra: the
    served path and the training checks) less what the GPU machine has, and the test runner from the dev lock."""
    trainer, dev = _pins(ROOT / TRAINER_LOCK), _pins(ROOT / "requirements-dev.lock")
    names = [n for n in trainer if not PRESENT.match(n)]
    return sorted({f"{n}=={trainer[n]}" for n in names} | {f"{n}=={dev.get(n) or trainer[n]}" for n in EXTRA})


def build_wheels(dest: Path, python: str | None = None) -> int:
    """pip download every wheel of `wheel_requirements()` (no dependencies: the lock is complete) into
    `dest`, for this machine's Python or `python` (e.g. 3.12); logs the total size, and warns past
    WHEELS_MAX_BYTES."""
    python_tags = ["--python-version", python] if python else []
    dest.mkdir(parents=True, exist_ok=True)
    reqs = dest / "requirements.txt"
    reqs.write_text("\n".join(wheel_requirements()) + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        *python_tags, "-d", str(dest), "-r", str(reqs)], check=False)
    if r.returncode:
        return r.returncode
    keep = {line.split("==")[0].lower() for line in reqs.read_text().split()}
    for wheel in dest.glob("*.whl"):  # wheels of an earlier list
        if wheel.name.split("-")[0].lower().replace("_", "-") not in keep:
            wheel.unlink()
    total = sum(w.stat().st_size for w in dest.glob("*.whl"))
    logger.info("%d wheels, %.1f MiB in %s", len(list(dest.glob("*.whl"))), total / 2**20, dest)
    if total > WHEELS_MAX_BYTES:  # still usable where the machine mounts it (docs/operations/testing.md)
        logger.warning("the wheelhouse is over %d MiB: more than a 64 MiB carry can take", WHEELS_MAX_BYTES // 2**20)
    return 0


# -- stages -------------------------------------------------------------------------------------------
def environment(device: str) -> dict[str, Any]:
    """What the machine has for training (torch, its CUDA, the GPU) and for the served path (ONNX Runtime's
    providers, the provider a session of the served backbone graph gets on `device`, faiss); StageFailed with
    all of it, and why, when `device` is a GPU that torch or ONNX Runtime cannot use."""
    import faiss
    import onnxruntime
    import torch

    from fragsearch.index.ann import gpu_available
    from fragsearch.model.backbone import backbone_graph
    from fragsearch.model.onnx import session

    gpu = device.startswith("cuda")
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                           "onnxruntime": onnxruntime.__version__,
                           "onnxruntime_providers": onnxruntime.get_available_providers()}
    problems = []
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), arch_list=torch.cuda.get_arch_list(),
                   kernels_for_this_gpu=f"sm_{props.major}{props.minor}" in torch.cuda.get_arch_list())
    elif gpu:
        problems.append(f"torch {torch.__version__} sees no GPU (CUDA build: {torch.version.cuda}): no training on it")
    graph = backbone_graph("int8")  # the served backbone graph (the release's)
    out.update(faiss=faiss.__version__, faiss_gpu=gpu_available(), served_graph=graph.name,
               served_graph_providers=session(graph, device).get_providers())
    want = "CUDAExecutionProvider" if gpu else "CPUExecutionProvider"
    if out["served_graph_providers"][0] != want:
        problems.append(f"the served graphs run on {out['served_graph_providers'][0]}, not {want}"
                        + " (onnxruntime-gpu, with the CUDA and cuDNN libraries it loads)" * gpu)
    if problems:
        raise StageFailed({**out, "why": "; ".join(problems)})
    return out


def run_tests(device: str, out_dir: Path, timeout: float) -> dict[str, Any]:
    xml = out_dir / "tests.xml"
    tests = TESTS if device.startswith("cuda") else DRY_RUN_TESTS
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", f"--junitxml={xml}", *tests]
    if device.startswith("cuda"):
        cmd[4:4] = ["-p", "tests.real_device"]
    env = {**os.environ, "GPU_CHECK_DEVICE": device}
    try:
        r = _run(cmd, timeout, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired as e:
        text = e.output if isinstance(e.output, str) else ""
        (out_dir / "tests.log").write_text(text)
        raise StageFailed({"timeout_seconds": round(timeout), "tail": text[-3000:]}) from e
    r.stdout, r.stderr = r.stdout or "", ""
    (out_dir / "tests.log").write_text(r.stdout + r.stderr)
    cases: list[dict[str, Any]] = []
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            entry: dict[str, Any] = {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                                     "seconds": float(case.get("time") or 0)}
            if outcome != "passed":
                entry["message"] = (next(c for c in case if c.tag == outcome).get("message") or "")[:500]
            cases.append(entry)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    if r.returncode not in (0,) or counts["failure"] or counts["error"] or not counts["passed"]:
        raise StageFailed({"returncode": r.returncode, "counts": counts, "cases": cases,
                           "tail": (r.stdout + r.stderr)[-3000:]})
    return {"tests": list(tests), "counts": counts, "cases": cases}


class StageFailed(Exception):
    def __init__(self, detail: dict[str, Any]) -> None:
        super().__init__(str(detail["why"]) if "why" in detail else json.dumps(detail.get("counts", {})))
        self.detail = detail


def _gpu_processes() -> set[int] | None:
    """The pids holding a CUDA context now (nvidia-smi), None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                       text=True, check=False, timeout=20)
    return {int(x) for x in r.stdout.split() if x.strip().isdigit()} if r.returncode == 0 else None


STAGE_LINES = {  # what service.prepare logs at the end of each stage
    "image_index_seconds": re.compile(r"image index: (\d+) images in (\d+)s"),
    "sentence_index_seconds": re.compile(r"sentence index: (\d+) sentences in (\d+)s"),
    "preparation_seconds": re.compile(r"preparation took ([\d.]+)s"),
    "workers_logged": re.compile(r"with (\d+) extraction workers"),
}


def first_start(device: str, data: Path, images: int, workers: int, out_dir: Path, timeout: float) -> dict[str, Any]:
    """The first start from an empty artifacts folder (removed afterwards)."""
    artifacts = Path(tempfile.mkdtemp(prefix="gpu-check-artifacts-"))
    try:
        return _first_start(device, data, images, workers, out_dir, timeout, artifacts)
    finally:
        shutil.rmtree(artifacts, ignore_errors=True)


def _first_start(device: str, data: Path, images: int, workers: int, out_dir: Path, timeout: float,
                 artifacts: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAGSEARCH_")}
    env.update(FRAGSEARCH_DEVICE=device, FRAGSEARCH_DATA=str(data), FRAGSEARCH_ARTIFACTS=str(artifacts),
               FRAGSEARCH_LIMIT=str(images), FRAGSEARCH_WORKERS=str(workers), FRAGSEARCH_PROGRESS_EVERY="10",
               PYTHONPATH=str(ROOT))
    seen: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            seen.update(_gpu_processes() or ())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    log = out_dir / "prepare.log"
    try:
        with log.open("w") as fh:  # written as it goes: `tail -f` it to follow the run
            r = _run([sys.executable, "-m", "fragsearch.service.prepare"], timeout, cwd=ROOT, env=env, stdout=fh,
                     stderr=subprocess.STDOUT)
    finally:
        stop.set()
        sampler.join()
    prepare_s = time.perf_counter() - t0
    text = log.read_text()
    out: dict[str, Any] = {"returncode": r.returncode, "wall_seconds": round(prepare_s, 1), "images": images,
                           "workers": workers, "data": str(data)}
    for key, pattern in STAGE_LINES.items():
        m = pattern.search(text)
        if m:
            out[key] = float(m.group(m.lastindex or 1)) if key != "workers_logged" else int(m.group(1))
    if device.startswith("cuda"):
        out["cuda_processes"] = len(seen) if _gpu_processes() is not None else None
    if r.returncode:
        raise StageFailed({**out, "tail": text[-3000:]})
    t1 = time.perf_counter()
    load = _run([sys.executable, "-c", LOAD_AND_SEARCH], max(30.0, timeout - (t1 - t0)), cwd=ROOT, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out["load_and_search_seconds"] = round(time.perf_counter() - t1, 1)
    if load.returncode:
        raise StageFailed({**out, "tail": (load.stderr or "")[-3000:]})
    out["search"] = json.loads((load.stdout or "").strip().splitlines()[-1])
    if out.get("cuda_processes") not in (None, 0, 1):
        raise StageFailed({**out, "why": "more than one process held a CUDA context: the extraction workers"})
    return out


LOAD_AND_SEARCH = """
import json, time
from fastapi.testclient import TestClient
from fragsearch.service.app import create_app, load_engine
from fragsearch.settings import Settings
settings = Settings()
t0 = time.perf_counter()
engine = load_engine(settings)
loaded = time.perf_counter() - t0
with TestClient(create_app(settings, engine=engine)) as c:
    r = c.post("/search/images", json={"sentence": "a dog runs through the grass", "k": 3})
    assert r.status_code == 200, r.text
    print(json.dumps({"load_seconds": round(loaded, 2), "device": str(engine.bundle.device),
                      "results": len(r.json()["results"]), "took_ms": r.json()["took_ms"]}))
"""


def _run_stage(report: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> bool:
    stage = Stage(name)
    logger.info("stage %s", name)
    t0 = time.perf_counter()
    try:
        stage.detail = fn()
        stage.ok = True
    except StageFailed as e:
        stage.detail, stage.error = e.detail, str(e)
    except Exception as e:  # recorded in the report: the check goes on with the next stage
        stage.error = f"{type(e).__name__}: {e}"
    stage.seconds = round(time.perf_counter() - t0, 1)
    logger.info("stage %s: %s in %.1fs%s", name, "ok" if stage.ok else "FAILED", stage.seconds,
                f" ({stage.error})" if stage.error else "")
    report["stages"].append(vars(stage))
    return stage.ok


def default_out() -> Path:
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "artifacts"
    return base / "gpu-check.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gpu-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, with --images 8 unless given")
    ap.add_argument("--out", type=Path, default=None, help="the JSON report (default $OUT/gpu-check.json, "
                    "else artifacts/gpu-check.json)")
    ap.add_argument("--data", type=Path, default=None, help="a Flickr8K folder (default FRAGSEARCH_DATA, else "
                    "../shared/data/flickr8k)")
    ap.add_argument("--images", type=int, default=None, help="images of the dev split (and training images' "
                    "captions) the first start prepares (default 50)")
    ap.add_argument("--workers", type=int, default=None, help="extraction processes (default: every core)")
    ap.add_argument("--only", action="append", choices=("environment", "tests", "first-start"),
                    help="run only these stages (repeatable)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds the whole check may take (default 480: "
                    "each stage gets what is left)")
    ap.add_argument("--build-wheels", type=Path, nargs="?", const=WHEELS, default=None, metavar="DIR",
                    help="download the wheelhouse into DIR (default artifacts/gpu-wheels) and exit")
    ap.add_argument("--python", default=None, help="with --build-wheels: the GPU machine's Python version, "
                    "when it is not this one's")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.build_wheels is not None:
        return build_wheels(args.build_wheels, args.python)
    device = "cpu" if args.dry_run else args.device
    images = args.images or (8 if args.dry_run else 50)
    workers = args.workers or len(os.sched_getaffinity(0))
    if args.data is None:
        from fragsearch.settings import (
            default_data_dir,  # the `data` setting (FRAGSEARCH_DATA, .env, fragsearch.toml)
        )

        args.data = default_data_dir()
    data = args.data
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    stages = args.only or ["environment", "tests", "first-start"]
    report: dict[str, Any] = {"device": device, "dry_run": args.dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "host": platform.node(), "stages": [], "logs": str(logs)}
    t0 = time.perf_counter()
    deadline = time.monotonic() + args.budget
    if "environment" in stages:
        _run_stage(report, "environment", lambda: environment(device))

    def left() -> float:
        return max(30.0, deadline - time.monotonic())

    if "tests" in stages:
        # the first start gets at least a third of what is left
        _run_stage(report, "tests", lambda: run_tests(device, logs, left() * (2 / 3 if "first-start" in stages else 1)))
    if "first-start" in stages:
        _run_stage(report, "first start", lambda: first_start(device, data, images, workers, logs, left()))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = all(s["ok"] for s in report["stages"])
    out.write_text(json.dumps(report, indent=1) + "\n")
    logger.info("%s in %.0fs: %s", "passed" if report["ok"] else "FAILED", report["seconds"], out)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
