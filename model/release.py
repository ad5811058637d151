"""The released model and the one answer to "which model is served".

The served default's trained files ship with the project in `model/released/`: the model in the runtime's
form (`model.json` and `model.npz`: weights, vocabulary, calibration references and relevance scale;
model/modelfile.py), the graphs it runs (the int8 image backbone and its ImageNet head, MiniLM's graph
without its weights, which come from MiniLM's package) and `manifest.json`, which says how it was made
(the command and the commit, digests of the training split it saw, the image-feature graph and the CPU it
was extracted on), what it measures (validation and dev), and the sha256 and size of every file. Reading a
file that sits beside a manifest checks it against it (`check_release`; a model.json with its model.npz):
a changed or truncated file is refused with its name, never served.

The manifest is written by `python -m fragsearch.training.release` only, never by hand.

Every command that needs "the served model" asks `served_model_path` (through the settings' `model_path`,
fragsearch/settings.py): the `model_path` setting when given, else `artifacts/models/<variant>/model.pt` when a
variant is named (a model trained here, `fragsearch train`), else the released model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fragsearch.model.atomic import sha256_file_once

RELEASE_DIR = Path(__file__).resolve().parent / "released"
RELEASED_MODEL = RELEASE_DIR / "model.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "fragsearch-release-1"


class ReleaseError(ValueError):
    """A released model's file does not match its manifest, or the manifest cannot be read."""


def served_model_path(artifacts: Path, variant: str | None = None, model_path: str | Path | None = None) -> Path:
    """The checkpoint to serve: `model_path` when given, else the trained variant's
    (<artifacts>/models/<variant>/model.pt) when a variant is named, else the released model."""
    if model_path:
        return Path(model_path)
    if variant:
        return Path(artifacts) / "models" / variant / "model.pt"
    return RELEASED_MODEL


def is_released(path: Path) -> bool:
    """Whether `path` is a file of a release folder (one with a manifest)."""
    return (Path(path).parent / MANIFEST).is_file()


def read_manifest(folder: Path = RELEASE_DIR) -> dict[str, Any]:
    """The manifest of a release folder; ReleaseError when it is missing or not a release manifest."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ReleaseError(f"no release manifest at {path}") from e
    except (OSError, ValueError) as e:
        raise ReleaseError(f"{path}: not a readable release manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT \
            or not isinstance(manifest.get("files"), dict):
        raise ReleaseError(f"{path} is not a fragsearch release manifest (format {MANIFEST_FORMAT})")
    return manifest


def check_release(path: Path) -> dict[str, Any] | None:
    """For a file inside a release folder (a model.json: with the model.npz beside it): check its size and
    sha256 against the manifest and return the manifest (None for a file outside any release). ReleaseError
    naming the file when it differs, is missing from the manifest, or the manifest is damaged."""
    path = Path(path)
    if not is_released(path):
        return None
    manifest = read_manifest(path.parent)
    _check_file(path, manifest)
    if path.name == "model.json":
        _check_file(path.parent / "model.npz", manifest)
    return manifest


def released_file(name: str, folder: Path = RELEASE_DIR) -> Path | None:
    """The file `name` of a release folder, checked against its manifest (`check_release`), or None when the
    release does not ship it."""
    path = Path(folder) / name
    if not path.is_file() or not is_released(path) or name not in read_manifest(folder)["files"]:
        return None
    check_release(path)
    return path


def _check_file(path: Path, manifest: dict[str, Any]) -> None:
    entry = manifest["files"].get(path.name)
    if not isinstance(entry, dict):
        raise ReleaseError(f"{path}: the release manifest {path.parent / MANIFEST} does not list this file")
    if not path.is_file():
        raise ReleaseError(f"{path}: missing from the release (restore it with git checkout)")
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise ReleaseError(f"{path}: {size} bytes where the release manifest records {entry.get('bytes')} "
                           "(a damaged or partial copy: restore it with git checkout, or write a new release "
                           "with python -m fragsearch.training.release)")
    digest = sha256_file_once(path)
    if digest != entry.get("sha256"):
        raise ReleaseError(f"{path}: sha256 {digest[:16]}… where the release manifest records "
                           f"{str(entry.get('sha256'))[:16]}… (the file was changed: restore it with git checkout, "
                           "or write a new release with python -m fragsearch.training.release)")
