"""The index's file helpers: content hashes and fresh file names. Crash-safe writes (temp file in
the same folder, fsync, rename, fsync the folder) are model/atomic.py's, imported from there by
every writer of model/, index/ and service/.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

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
