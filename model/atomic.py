"""Atomic file writes, the one helper of model/ and index/: a temp file beside the target, fsynced,
renamed onto it, then the folder fsynced (so the rename survives a power cut). Beside it, the disk
caches' one "key -> cached file, computed when missing" (`cached_file`).

A reader never sees a half-written file, and a crash leaves the previous version (or nothing) in
place plus at most a temp file named ``.<pid>.<target name>.<random>.tmp``, which `stale_temps`
finds once its writer is gone (the index removes the ones in its folder at its next save).

Beside them `sha256_file`, the content hash of a file the index and the checkpoints record (`sha256_file_once`:
once per process for a file unchanged since).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

TMP_SUFFIX = ".tmp"

T = TypeVar("T")


def sha256_file(path: Path | str) -> str:
    """The sha256 of a file's content (hex)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (file, size, mtime_ns) -> sha256


def sha256_file_once(path: Path | str) -> str:
    """`sha256_file`, computed once per process for a file of one size and modification time (weight
    files checked at every load)."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]


def fsync_dir(folder: Path) -> None:
    """Make renames in ``folder`` durable (a no-op where directories cannot be opened)."""
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


def temp_path(path: Path) -> Path:
    """A fresh temp name beside ``path`` (not created): ``.<pid>.<name>.<random>.tmp``."""
    return path.with_name(f".{os.getpid()}.{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temp path beside ``path`` for a writer that wants a file name (the body creates the file);
    fsynced and renamed onto ``path`` when the block succeeds, removed when it fails."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file handle whose content replaces ``path`` atomically when the block succeeds."""
    with atomic_path(path) as tmp, open(tmp, "xb") as fh:
        yield fh
        fh.flush()


def cached_file(path: Path, make: Callable[[], T], write: Callable[[T, BinaryIO], object],
                read: Callable[[Path], T]) -> T:
    """The value cached at ``path`` (``read``), or ``make()``'s, written there atomically by ``write``
    when the file is missing. Runs may share a cache: each writes its own temp file, a reader never
    sees half a file, and two makers of one entry each leave a whole one."""
    path = Path(path)
    if path.is_file():
        return read(path)
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh:
        write(value, fh)
    return value


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
