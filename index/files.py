"""The index's file helpers: content hashes and fresh file names. Crash-safe writes (temp file in
the same folder, fsync, rename, fsync the folder) are model/atomic.py's, imported from there by
every writer of model/, index/ and service/.
"""

from __future__ import annotations

import secrets

from model.atomic import sha256_file

__all__ = ["sha256_file", "unique_name"]


def unique_name(prefix: str, generation: int, suffix: str) -> str:
    """A file name no earlier or concurrent save can have used."""
    return f"{prefix}-{generation:06d}-{secrets.token_hex(4)}{suffix}"
