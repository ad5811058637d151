"""Keep an image index in step with a folder of photos, safe to re-run and to interrupt: the walk (hidden files,
NAS folders and gitignore-style patterns left out), the manifest kept in the index folder, and `sync_folder`,
which adds new files, re-extracts changed ones, follows renames and moves through the content-keyed feature
cache, removes images whose file is gone and reports what it cannot read. The command is `fragsearch index`
(fragsearch/commands/index_sync.py, which says more; `python -m fragsearch.index.sync` is its alias)."""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from fragsearch.index.catalogue import is_index
from fragsearch.index.files import is_hidden, sha256_file
from fragsearch.index.images import ImageIndex
from fragsearch.index.shards import commit_interval
from fragsearch.index.types import BackendOptions, IndexSettings
from fragsearch.model.atomic import atomic_file
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import feature_cache
from fragsearch.model.imageio import IMAGE_SUFFIXES

logger = logging.getLogger(__name__)

MANIFEST = "sync-manifest.json"
UNSUPPORTED_SUFFIXES = (".cr2", ".cr3", ".nef", ".arw", ".dng", ".raf", ".orf", ".rw2", ".raw", ".srw", ".pef")
SAVE_EVERY = 500


@dataclass
class Entry:
    size: int
    mtime_ns: int
    sha256: str
    image_id: int


@dataclass
class SyncReport:
    """What a sync did, by file path relative to the folder."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{len(self.added)} added, {len(self.changed)} changed, {len(self.renamed)} renamed, "
                f"{len(self.removed)} removed, {self.unchanged} unchanged, {len(self.unreadable)} unreadable, "
                f"{len(self.unsupported)} unsupported")


def read_manifest(index_dir: Path) -> dict[str, Entry]:
    path = index_dir / MANIFEST
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {rel: Entry(**e) for rel, e in data["files"].items()}


def write_manifest(index_dir: Path, folder: Path, files: dict[str, Entry]) -> None:
    body = {"folder": str(folder), "files": {rel: vars(e) for rel, e in sorted(files.items())}}
    with atomic_file(index_dir / MANIFEST) as f:
        f.write(json.dumps(body, indent=1).encode())


# folders NAS systems, file managers and operating systems keep beside photos (every hidden folder, such as
# .thumbnails or .Trash-1000, is left out as well)
SYSTEM_FOLDERS = frozenset({"@eaDir", "@Recycle", "@Recently-Snapshot", "#recycle", "#snapshot", "$RECYCLE.BIN",
                            "System Volume Information", "lost+found"})
IGNORE_FILE = ".fragsearchignore"  # gitignore-style patterns, one a line, in the folder itself


def ignore_patterns(folder: Path, exclude: Sequence[str] = ()) -> list[str]:
    """The patterns a sync leaves out: `exclude` and the lines of the folder's .fragsearchignore (blank
    lines and # comments skipped)."""
    patterns = [p.strip() for p in exclude if p.strip()]
    path = Path(folder) / IGNORE_FILE
    if path.is_file():
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        patterns += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return patterns


def ignored(rel: str, is_dir: bool, patterns: Sequence[str]) -> bool:
    """Whether a path relative to the folder matches a gitignore-style pattern: a pattern without a slash
    matches a file or folder name at any depth (`*.png`, `Screenshots`), one with a slash the path from the
    folder (`2019/*/raw`, a leading slash anchors it too), a trailing slash folders only; `**` matches any
    number of folders. Negation (`!`) is not supported."""
    name = rel.rsplit("/", 1)[-1]
    for pattern in patterns:
        dir_only = pattern.endswith("/")
        pat = pattern.rstrip("/")
        if dir_only and not is_dir:
            continue
        if "/" in pat:
            regex = _glob_regex(pat.lstrip("/"))
            if re.fullmatch(regex, rel):
                return True
        elif fnmatch.fnmatchcase(name, pat):
            return True
    return False


@functools.cache
def _glob_regex(pattern: str) -> str:
    """A path glob as a regex: `**/` any folders, `*` and `?` within one name, [...] as in fnmatch."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            j = pattern.find("]", i + 1) if pattern[i] == "[" else -1
            if j > 0:
                out.append(fnmatch.translate(pattern[i : j + 1])[4:-3])  # the class itself, as fnmatch reads it
                i = j + 1
            else:
                out.append(re.escape(pattern[i]))
                i += 1
    return "".join(out)


def walk(folder: Path, exclude: Sequence[str] = ()) -> tuple[dict[str, os.stat_result], list[str]]:
    """Indexable files (relative POSIX path -> stat) and unsupported image files under `folder`; hidden
    files and folders, SYSTEM_FOLDERS and what the ignore patterns (`ignore_patterns`) match left out."""
    found: dict[str, os.stat_result] = {}
    unsupported: list[str] = []
    patterns = ignore_patterns(folder, exclude)
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath).relative_to(folder).as_posix()
        prefix = "" if here == "." else here + "/"
        dirnames[:] = sorted(d for d in dirnames if not is_hidden(d) and d not in SYSTEM_FOLDERS
                             and not ignored(prefix + d, True, patterns))
        for name in sorted(filenames):
            if is_hidden(name) or ignored(prefix + name, False, patterns):
                continue
            path = Path(dirpath) / name
            rel = prefix + name
            suffix = path.suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                try:
                    found[rel] = path.stat()
                except OSError:  # vanished meanwhile
                    continue
            elif suffix in UNSUPPORTED_SUFFIXES:
                unsupported.append(rel)
    return found, unsupported


def sync_folder(index: ImageIndex, folder: Path, workers: int = 1, save_every: int = SAVE_EVERY,
                exclude: Sequence[str] = ()) -> SyncReport:
    """Bring `index` (loaded with collection_root=folder) in step with the files under `folder` (those `walk`
    keeps: a file that becomes ignored is removed like a deleted one)."""
    folder = Path(folder).resolve()
    report = SyncReport()
    manifest = {rel: e for rel, e in read_manifest(index.root).items() if index.contains(e.image_id)}
    on_disk, report.unsupported = walk(folder, exclude)
    # images committed by an interrupted run before its manifest was written: adopt them
    adopt = index.photos.find([folder / rel for rel in on_disk if rel not in manifest])
    for path, image_id in adopt.items():
        rel = Path(path).relative_to(folder).as_posix()
        st = on_disk[rel]
        manifest[rel] = Entry(st.st_size, st.st_mtime_ns, sha256_file(folder / rel), image_id)

    vanished = {rel: e for rel, e in manifest.items() if rel not in on_disk}
    by_hash = {e.sha256: rel for rel, e in vanished.items()}
    to_add: list[str] = []
    to_remove: list[int] = []
    digests: dict[str, str] = {}  # content hashes read while checking, reused for the manifest
    for rel, st in tqdm(on_disk.items(), desc="checking", unit="file", disable=len(on_disk) < 1000):
        old = manifest.get(rel)
        if old is not None and old.size == st.st_size and old.mtime_ns == st.st_mtime_ns:
            report.unchanged += 1
            continue
        digest = digests[rel] = sha256_file(folder / rel)
        if old is not None and old.sha256 == digest:  # touched, not changed
            manifest[rel] = Entry(st.st_size, st.st_mtime_ns, digest, old.image_id)
            report.unchanged += 1
            continue
        if old is not None:
            report.changed.append(rel)
            to_remove.append(old.image_id)
            del manifest[rel]
        elif digest in by_hash:
            was = by_hash.pop(digest)
            report.renamed.append((was, rel))
        else:
            report.added.append(rel)
        to_add.append(rel)
    renamed_from = {was for was, _ in report.renamed}
    for rel, e in vanished.items():
        if rel not in renamed_from:
            report.removed.append(rel)
        to_remove.append(e.image_id)
        del manifest[rel]

    for image_id in to_remove:
        index.remove(image_id)
    if to_remove:
        index.save()
        write_manifest(index.root, folder, manifest)
    bar = tqdm(total=len(to_add), desc=f"indexing {folder.name}", unit="img", disable=not to_add)
    failed: set[str] = set()
    start = 0
    while start < len(to_add):
        part = to_add[start : start + commit_interval(len(index), save_every)]
        start += len(part)
        added = index.photos.add([folder / rel for rel in part], workers=workers)
        for path, reason in added.skipped:
            rel = Path(path).relative_to(folder).as_posix() if Path(path).is_relative_to(folder) else path
            report.unreadable.append((rel, reason))
            failed.add(rel)
        index.save()
        ids = index.photos.find([folder / rel for rel in part])
        for path, image_id in ids.items():
            rel = Path(path).relative_to(folder).as_posix()
            st = on_disk[rel]
            manifest[rel] = Entry(st.st_size, st.st_mtime_ns, digests[rel], image_id)  # every added file was hashed
        write_manifest(index.root, folder, manifest)
        bar.update(len(part))
    bar.close()
    if failed:  # an unreadable file is not added: it is neither new nor changed in the report
        report.added = [r for r in report.added if r not in failed]
        report.changed = [r for r in report.changed if r not in failed]
        report.renamed = [(a, b) for a, b in report.renamed if b not in failed]
    write_manifest(index.root, folder, manifest)
    index.photos.read_missing_places()  # images indexed before the date and place were kept
    logger.info("synced %s into %s: %s", folder, index.root, report.summary())
    return report


def open_index(out: Path, bundle: Bundle, folder: Path, cache_dir: Path, settings: IndexSettings,
               backend: BackendOptions | None = None) -> ImageIndex:
    """The collection's index at `out` (made when missing), reading paths against `folder`; `backend`
    is where its candidate vectors live (FAISS in-process by default, or Milvus)."""
    cache = feature_cache(cache_dir, bundle.image_cfg, artifacts=bundle.places.artifacts)
    if is_index(out):
        return ImageIndex.load(out, bundle, cache=cache, collection_root=folder, backend=backend)
    return ImageIndex.create(out, bundle, settings, cache=cache, collection_root=folder, backend=backend)


if __name__ == "__main__":  # `python -m fragsearch.index.sync`, as the docs write it: the command's alias
    from fragsearch.commands.index_sync import main

    raise SystemExit(main())
