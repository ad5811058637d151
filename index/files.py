"""Crash-safe file writes: temp file in the same folder, fsync, rename, fsync the folder.

A crash before the rename leaves the previous file untouched (and a stray temp file that the next
save removes).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

TMP_SUFFIX = ".tmp"
HASH_CHUNK = 1 << 22


def fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; once the body has written it, fsync and rename it onto `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def unique_name(prefix: str, generation: int, suffix: str) -> str:
    """A file name no earlier or concurrent save can have used."""
    return f"{prefix}-{generation:06d}-{secrets.token_hex(4)}{suffix}"
