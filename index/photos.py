"""The files behind an image index: where they are, the features they are read through, when and where
they were taken.

`Photos` is the photo folder of one `ImageIndex` (`fragsearch.index.photos`): paths stored relative to the
collection root (so that the index still finds its images where the collection is mounted elsewhere,
host / container) and read back against it; image files added through the feature cache (a temporary
one when the index has none), found by path, and their EXIF date and place (index.places) read,
filtered on, and read for rows indexed before they were kept.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from fragsearch.index.catalogue import Catalogue
from fragsearch.index.files import is_hidden
from fragsearch.index.items import ItemTable
from fragsearch.index.places import Place, PlaceFilter, read_place
from fragsearch.index.types import AddReport
from fragsearch.model.bundle import Bundle
from fragsearch.model.cache import FeatureCache
from fragsearch.model.image import ImageFragments

logger = logging.getLogger(__name__)

ADD_CHUNK = 64  # images embedded and inserted at a time by `Photos.add`
PLACE_COLUMNS = ("taken", "lat", "lon", "exif_read")


class PhotoIndex(Protocol):
    """What the photo folder reads and calls of its image index (index.images.ImageIndex)."""

    @property
    def root(self) -> Path: ...
    @property
    def bundle(self) -> Bundle: ...
    @property
    def catalogue(self) -> Catalogue: ...
    @property
    def items(self) -> ItemTable[Any]: ...
    def reading(self) -> AbstractContextManager[None]: ...
    def contains(self, item: int) -> bool: ...
    def add(self, images: Sequence[Any], names: Sequence[str], paths: Sequence[Path | str],
            read_places: bool = True) -> list[int]: ...


class Photos:
    """The image files of an index: path mapping, the feature cache, adding files, EXIF date and place."""

    def __init__(self, index: PhotoIndex, collection_root: Path | None, cache: FeatureCache | None) -> None:
        self.index = index
        self.root = None if collection_root is None else Path(collection_root).resolve()
        self.cache = cache

    # -- paths ----------------------------------------------------------------------------------------
    def stored_path(self, path: Path | str) -> str:
        """How `path` is stored: relative to the collection root (POSIX form) when under it, else as given."""
        root = self.root
        if root is not None:
            p = Path(path)
            full = p if p.is_absolute() else p.resolve()
            if full.is_relative_to(root):
                return full.relative_to(root).as_posix()
        return str(path)

    def real_path(self, stored: str) -> str:
        """The file of a stored path: relative ones are read against the collection root."""
        if self.root is None or Path(stored).is_absolute():
            return stored
        return str(self.root / stored)

    def find(self, paths: Sequence[Path | str]) -> dict[str, int]:
        """Live images among `paths` (compared as given, resolve them first) -> their ids."""
        index = self.index
        given = {self.stored_path(p): str(p) for p in paths}
        wanted = set(given)
        with index.reading():
            found = {p.path: i for i, p in index.items.pending.items() if p.path in wanted and index.contains(i)}
            found.update({str(path): i for i, path in index.catalogue.lookup("path", sorted(wanted))
                          if index.contains(i)})
        return {given[stored]: i for stored, i in found.items()}

    # -- adding files ---------------------------------------------------------------------------------
    def add(self, paths: Sequence[Path | str], workers: int = 1, skip_present: bool = True) -> AddReport:
        """Index image files. Unreadable files are skipped and listed; with `skip_present`, files whose
        path is indexed already are not added again. Features go through the feature cache (a
        temporary one when the index has none), extracted by `workers` processes."""
        report = AddReport()
        todo: list[Path] = []
        seen: set[Path] = set()
        for p in paths:
            path = Path(p).resolve()
            if is_hidden(path.name):
                report.skipped.append((str(path), "hidden file name"))
            elif path not in seen:
                seen.add(path)
                todo.append(path)
        if skip_present:
            present = self.find(todo)
            report.present = len(present)
            todo = [p for p in todo if str(p) not in present]
        # a cache entry is keyed by file name: images sharing a name go in separate rounds
        rounds: list[list[Path]] = []
        seen_names: dict[str, int] = {}
        for path in todo:
            n = seen_names[path.name] = seen_names.get(path.name, -1) + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append(path)
        for batch in rounds:
            with self.features() as cache:
                ensured = cache.ensure(batch, workers=workers)
                failed = dict(ensured.failed)
                report.skipped += [(str(p), failed[p.name]) for p in batch if p.name in failed]
                good = [p for p in batch if p.name not in failed]
                bar = tqdm(total=len(good), desc=f"indexing {self.index.root.name}", unit="img",
                           disable=len(good) < 50)
                for start in range(0, len(good), ADD_CHUNK):
                    chunk = good[start : start + ADD_CHUNK]
                    frags = [cache.load_or_reason(p) for p in chunk]
                    ok = [(p, f) for p, f in zip(chunk, frags, strict=True) if isinstance(f, ImageFragments)]
                    report.skipped += [(str(p), f) for p, f in zip(chunk, frags, strict=True) if isinstance(f, str)]
                    report.added += self.index.add([f for _, f in ok], [p.name for p, _ in ok], [p for p, _ in ok])
                    bar.update(len(chunk))
                bar.close()
        if report.skipped:
            logger.warning("%d unreadable images skipped (first: %s)", len(report.skipped), report.skipped[0])
        logger.info("added %d images to %s (%d skipped, %d already indexed)", len(report.added), self.index.root,
                    len(report.skipped), report.present)
        return report

    @contextlib.contextmanager
    def features(self) -> Iterator[FeatureCache]:
        """The feature cache, or a temporary one for the time of the block."""
        if self.cache is not None:
            yield self.cache
            return
        bundle = self.index.bundle
        with tempfile.TemporaryDirectory(prefix="fragsearch-features-") as tmp:
            yield FeatureCache(Path(tmp), bundle.image_cfg, str(bundle.device), places=bundle.places)

    # -- date and place -------------------------------------------------------------------------------
    def allowed(self, where: PlaceFilter) -> np.ndarray:
        """Ids of the live images that pass the date and place filter, sorted (caller may hold `reading`)."""
        index = self.index
        cond, params = where.sql()
        with index.reading():
            rows = index.catalogue.select(["taken", "lat", "lon"], cond, params)
            pending = [(i, p.place or Place()) for i, p in index.items.pending.items() if index.contains(i)]
            rows += [(i, pl.taken, pl.lat, pl.lon) for i, pl in pending]
            if not rows:
                return np.zeros(0, np.int64)
            table = np.asarray([[np.nan if v is None else float(v) for v in r[1:]] for r in rows], dtype=np.float64)
            ids = np.asarray([int(r[0]) for r in rows], dtype=np.int64)
            keep = where.keeps(table[:, 0], table[:, 1], table[:, 2])
            ids = ids[keep]
            ids = ids[index.items.live_among(ids)] if len(ids) else ids
        return np.unique(ids)

    def read_missing_places(self) -> int:
        """Read the EXIF date and place of saved images indexed before they were kept (their
        `exif_read` is NULL) and store them; how many were read."""
        catalogue = self.index.catalogue
        rows = catalogue.select(["path"], "exif_read IS NULL", [])
        if not rows:
            return 0
        updates = []
        for image_id, path in tqdm(rows, desc="reading EXIF", unit="img", disable=len(rows) < 200):
            pl = read_place(self.real_path(str(path)))
            updates.append((pl.taken, pl.lat, pl.lon, 1, int(image_id)))
        catalogue.update_columns(PLACE_COLUMNS, updates)
        logger.info("read the EXIF date and place of %d images indexed before they were kept", len(updates))
        return len(updates)
