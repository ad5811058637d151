"""On-disk image feature cache: one ``.npz`` per image under a folder keyed by the feature settings.

An entry is named by the image's content (a hash of the file's bytes), not by its file name: two
different photos with the same name and size never share features, and a renamed or copied photo
is not extracted again. Entries are written atomically (temp file + fsync + rename), so an interrupted run leaves only
complete entries and the next run resumes with what is missing. Unreadable files are skipped,
counted and listed in ``failed.json``. The keys and the entry format are model/features.py's; the
extraction itself (in process or in worker processes) is model/extraction.py's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fragsearch.model.atomic import atomic_file, stale_temps
from fragsearch.model.config import ImageConfig
from fragsearch.model.extraction import ExtractionPool
from fragsearch.model.features import (
    PhotoReader,
    config_key,
    config_payload,
    entry_name,
    feature_dim,
    read_entry,
)
from fragsearch.model.image import ImageFragments
from fragsearch.model.places import DEFAULT_PLACES, Places

logger = logging.getLogger(__name__)

FAILED_FILE = "failed.json"
CONFIG_FILE = "config.json"


@dataclass
class CacheReport:
    """What one ``ensure`` call did: counts, failures (name, reason) and wall-clock seconds."""

    extracted: int
    reused: int
    failed: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.extracted / self.seconds if self.seconds > 0 else 0.0


def _write_json(path: Path, obj: object) -> None:
    with atomic_file(path) as fh:
        fh.write(json.dumps(obj, indent=1, sort_keys=True).encode())


# -- the cache ------------------------------------------------------------------------------------


class FeatureCache:
    """Image fragments cached under ``root / config_key(cfg)``, one ``<content key>.npz`` per image.

    Images are given as paths; their content keys are remembered per (path, size, mtime). ``places``: where the
    extractor's files are (model/places.py), and what a fine-tuned backbone's path is read against."""

    def __init__(self, root: Path, cfg: ImageConfig, device: str = "cpu", runtime: str = "auto",
                 places: Places = DEFAULT_PLACES) -> None:
        self.root = Path(root)
        self.cfg = cfg
        self.device = device
        self.runtime = runtime
        self.places = places
        self.dir = self.root / config_key(cfg, places)
        self._keys: dict[tuple[str, int, int], str] = {}

    def key(self, path: str | Path) -> str:
        """The content key of the image file at ``path`` (OSError if it cannot be read)."""
        st = os.stat(path)
        memo = (str(path), st.st_size, st.st_mtime_ns)
        key = self._keys.get(memo)
        if key is None:
            key = self._keys[memo] = PhotoReader.of(self.cfg).key(Path(path).read_bytes())
        return key

    def path(self, image: str | Path) -> Path:
        """Where the entry of the image file at ``image`` is (or would be) stored."""
        return self.dir / f"{self.key(image)}.npz"

    def has(self, image: str | Path) -> bool:
        """True once the image's entry is complete on disk (temp files do not count)."""
        try:
            return self.path(image).is_file()
        except OSError:
            return False

    def failed(self) -> dict[str, str]:
        """Names recorded as unreadable → reason."""
        f = self.dir / FAILED_FILE
        return dict(json.loads(f.read_text())) if f.is_file() else {}

    def ensure(self, paths: Sequence[Path], workers: int = 1, batch: int = 8, progress: bool = True) -> CacheReport:
        """Extract the images that have no entry yet; unreadable files are skipped and recorded."""
        start = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        if not (self.dir / CONFIG_FILE).is_file():
            _write_json(self.dir / CONFIG_FILE, config_payload(self.cfg, self.places))
        todo: list[Path] = []
        seen: set[str] = set()
        reused = 0
        for p in paths:
            try:
                key = self.key(p)
            except OSError:
                key = f"unreadable:{p}"
            if key in seen:
                continue
            seen.add(key)
            if self.has(p):
                reused += 1
            else:
                todo.append(Path(p))
        extracted = 0
        failed: list[tuple[str, str]] = []
        if todo:
            logger.info("extracting %d images (%d cached) into %s with %d worker(s)",
                        len(todo), reused, self.dir, workers)
            with ExtractionPool(self.cfg, self.device, min(workers, max(1, len(todo) // max(1, batch))),
                                self.runtime, self.places) as pool:
                extracted, failed = pool.run(todo, batch=batch, out_dir=self.dir, progress=progress)
        self._record_failures(todo, failed)
        for name, reason in failed:
            logger.warning("skipped %s: %s", name, reason)
        report = CacheReport(extracted, reused, sorted(failed), time.perf_counter() - start)
        if extracted:
            logger.info("extracted %d images in %.1f s (%.1f images/s), %d skipped",
                        extracted, report.seconds, report.images_per_s, len(failed))
        return report

    def load(self, images: Sequence[str | Path]) -> list[ImageFragments]:
        """Cached fragments of each image file (features float32); KeyError if one is missing."""
        return [read_entry(self._existing(n)) for n in images]

    def load_or_reason(self, image: str | Path) -> ImageFragments | str:
        """The cached fragments of one image file (entries are keyed by the file's content); a reason
        string when the file cannot be read or changed after it was extracted."""
        try:
            return self.load([image])[0]
        except KeyError as e:
            return f"unreadable: {e.args[0] if e.args else e}"

    def load_arrays(self, images: Sequence[str | Path]) -> tuple[np.ndarray, np.ndarray]:
        """→ features (N, F, D) float32 (D: ``feature_dim``), boxes (N, F, 4) float32, in the order of ``images``."""
        n_frag, dim = self.cfg.n_fragments, feature_dim(self.cfg)
        feats = np.empty((len(images), n_frag, dim), dtype=np.float32)
        boxes = np.empty((len(images), n_frag, 4), dtype=np.float32)
        for k, image in enumerate(images):
            with np.load(self._existing(image)) as z:
                f, b = z["features"], z["boxes"]
                if f.shape != (n_frag, dim):
                    raise ValueError(f"{entry_name(image)}: cached features {f.shape}, expected {(n_frag, dim)}")
                feats[k] = f
                boxes[k] = b
        return feats, boxes

    # -- internals ---------------------------------------------------------------------------------

    def _existing(self, image: str | Path) -> Path:
        try:
            path = self.path(image)
        except OSError as e:
            raise KeyError(f"{image} cannot be read: {e}") from e
        if not path.is_file():
            raise KeyError(f"{entry_name(image)} is not in the feature cache {self.dir}")
        return path

    def _record_failures(self, attempted: Sequence[Path], failed: Sequence[tuple[str, str]]) -> None:
        known = self.failed()
        tried = {entry_name(p) for p in attempted}
        merged = {n: r for n, r in known.items() if n not in tried}
        merged.update(dict(failed))
        if merged != known:
            _write_json(self.dir / FAILED_FILE, merged)

    def _remove_stale_temps(self) -> None:
        """Delete temp files left by writers that no longer run (an interrupted earlier run)."""
        for tmp in stale_temps(self.dir):
            with contextlib.suppress(OSError):
                tmp.unlink()
