"""The index's file helpers: content hashes and fresh file names. Crash-safe writes (temp file in
the same folder, fsync, rename, fsync the folder) are model/atomic.py's, re-exported here.

A crash before the rename leaves the previous file untouched (and a stray temp file that the next
save removes).
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from model.atomic import TMP_SUFFIX, atomic_path, fsync_dir

__all__ = ["HASH_CHUNK", "TMP_SUFFIX", "atomic_path", "fsync_dir", "sha256_file", "unique_name"]

HASH_CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def unique_name(prefix: str, generation: int, suffix: str) -> str:
    """A file name no earlier or concurrent save can have used."""
    return f"{prefix}-{generation:06d}-{secrets.token_hex(4)}{suffix}"
