"""The index's file helpers: content hashes and fresh file names. Crash-safe writes (temp file in
the same folder, fsync, rename, fsync the folder) are model/atomic.py's, imported from there by
every writer of model/, index/ and service/.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from fragsearch.model.atomic import sha256_file
from fragsearch.model.imageio import IMAGE_SUFFIXES

__all__ = ["is_hidden", "list_images", "sha256_file", "unique_name"]


def is_hidden(*parts: str) -> bool:
    """Whether a path, given by its names (a file's or folder's name, or every part of a relative path), is
    hidden: one of them starts with a dot. Hidden files and folders are never indexed or watched."""
    return any(part.startswith(".") for part in parts)


def unique_name(prefix: str, generation: int, suffix: str) -> str:
    """A file name no earlier or concurrent save can have used."""
    return f"{prefix}-{generation:06d}-{secrets.token_hex(4)}{suffix}"


def list_images(folder: Path, recursive: bool = True) -> list[Path]:
    """Image files under `folder` (by suffix), sorted; hidden files and folders are left out."""
    folder = Path(folder)
    pattern = folder.rglob("*") if recursive else folder.glob("*")
    return sorted(p for p in pattern if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                  and not is_hidden(*p.relative_to(folder).parts))
