"""Atomic file writes: a temp file beside the target, fsynced, then renamed onto it.

A reader never sees a half-written file, and a crash leaves the previous version (or nothing) in
place plus at most a temp file named ``.<pid>.<target name>.<random>.tmp``, which `stale_temps`
finds once its writer is gone.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temp path beside ``path`` for a writer that wants a file name; renamed onto ``path`` (after
    an fsync) when the block succeeds, removed when it fails."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{os.getpid()}.{path.name}.", suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file handle whose content replaces ``path`` atomically when the block succeeds."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        yield fh
        fh.flush()


def stale_temps(folder: Path) -> Iterator[Path]:
    """Temp files in ``folder`` whose writing process no longer runs (an interrupted earlier run)."""
    for tmp in folder.glob(f".*{TMP_SUFFIX}"):
        field = tmp.name.split(".")[1]  # ".<pid>.<name>.<random>.tmp"
        pid = int(field) if field.isdigit() else None
        if pid is not None and (pid == os.getpid() or _alive(pid)):
            continue  # still being written
        yield tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
