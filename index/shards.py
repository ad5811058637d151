"""Fragment shards: extracted image fragments in files of up to ``shard_size`` images, the hand-off
between bulk extraction (``index/bulk.py``, on worker processes or on Ray) and an index.

A shard folder holds ``manifest.json`` (the feature settings, as the feature cache names them) and
``shard-<n>.npz`` files, each written atomically (``model/atomic.py``) with

    keys      (K,)          content keys of the image files (``model/features.py content_key``)
    names     (K,)          file names
    paths     (K,)          the files' absolute paths
    sizes     (K, 2)        int64 width, height
    boxes     (K, F, 4)     float32 [x0, y0, x1, y1] in each image's pixels, row 0 the whole image
    features  (K, F, D)     float16 (as the feature cache stores them; D = model.features.feature_dim)

or, in a folder of embedded shards (``ShardWriter(..., embedded_by=model fingerprint)``: the model ran
where the shards were made, e.g. next to the extraction on a GPU), instead of ``features``

    vectors   (K, F, h)     float16 image fragments of that model (``Bundle.embed_images``)
    labels    (K, F)        each fragment's detector label ("" where none; ``model.features.fragment_labels``),
                            present when the model's features carry the detector's classes (the vectors
                            no longer do)

and ``failed.json`` (file name → why it was skipped). A shard on disk is complete; an interrupted run
loses only the images it had not yet written, and the next run extracts those (`done_paths`).
`load_shards` adds shards to an image index through its ``add_extracted`` call (``add_vectors`` for
embedded shards, whose model must be the index's) only, so any candidate backend behind
``ImageIndex`` loads the same shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fragsearch.index.images import ImageIndex, embedded_images
from fragsearch.model.atomic import atomic_file
from fragsearch.model.cache import config_key, config_payload, read_entry
from fragsearch.model.config import ImageConfig
from fragsearch.model.features import feature_dim
from fragsearch.model.image import ImageFragments

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
FAILED_FILE = "failed.json"
SHARD_PATTERN = re.compile(r"^shard-(\d+)\.npz$")
DEFAULT_SHARD_SIZE = 256  # images per shard: ~13 MB of float16 features at 20 fragments
LOAD_CHUNK = 64  # images embedded and inserted at a time when loading
COMMIT_IMAGES = 65_536  # images loaded between two commits of a load


def commit_interval(size: int, least: int) -> int:
    """Images to add before the next commit of an index of `size` images: at least `least`, a quarter
    of the size beyond that, at most COMMIT_IMAGES. A commit rewrites the candidate index (and a
    sync's manifest), so an interval that grows with the collection keeps a large load linear."""
    return max(least, min(COMMIT_IMAGES, size // 4))


class ShardError(ValueError):
    """A shard folder that does not fit the request (other feature settings, a broken shard)."""


@dataclass
class Shard:
    """One shard's content; see the module docstring for the shapes."""

    keys: list[str]
    names: list[str]
    paths: list[str]
    sizes: np.ndarray
    boxes: np.ndarray
    features: np.ndarray  # (K, F, D) features, or (K, F, h) vectors of an embedded shard
    embedded: bool = False
    labels: np.ndarray | None = None  # (K, F) str, an embedded shard's detector labels ("" none), None without

    def labels_of(self, k: int) -> tuple[str | None, ...]:
        """Image k's fragment labels as an index stores them (None where none; () when the shard has none)."""
        return () if self.labels is None else tuple(str(v) or None for v in self.labels[k])

    def __len__(self) -> int:
        return len(self.keys)

    def fragments(self, k: int) -> ImageFragments:
        """Image k of the shard as ImageFragments (features float32)."""
        return ImageFragments(self.boxes[k], self.features[k].astype(np.float32), int(self.sizes[k, 0]),
                              int(self.sizes[k, 1]))


def shard_settings(cfg: ImageConfig) -> ImageConfig:
    """The settings shards are made with: always the whole image + every region (a full-frame model
    reads row 0), as in the shared feature cache."""
    return dataclasses.replace(cfg, full_frame_only=False)


def shard_files(folder: Path) -> list[Path]:
    """The complete shards in ``folder``, in order."""
    if not Path(folder).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(folder).iterdir() if (m := SHARD_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def read_shard(path: Path) -> Shard:
    """One shard file back (ShardError if it is not a shard)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            embedded = "vectors" in z.files
            shard = Shard([str(v) for v in z["keys"]], [str(v) for v in z["names"]], [str(v) for v in z["paths"]],
                          z["sizes"].astype(np.int64), z["boxes"].astype(np.float32),
                          z["vectors" if embedded else "features"], embedded,
                          z["labels"].astype(str) if "labels" in z.files else None)
    except (OSError, KeyError, ValueError) as e:
        raise ShardError(f"{path}: not a fragment shard ({e})") from e
    n = len(shard.keys)
    if not (len(shard.names) == len(shard.paths) == len(shard.sizes) == len(shard.boxes) == len(shard.features) == n):
        raise ShardError(f"{path}: its arrays disagree on the number of images")
    if shard.labels is not None and shard.labels.shape != shard.features.shape[:2]:
        raise ShardError(f"{path}: labels {shard.labels.shape} for fragments {shard.features.shape[:2]}")
    return shard


def read_manifest(folder: Path) -> dict[str, Any] | None:
    f = Path(folder) / MANIFEST_FILE
    return dict(json.loads(f.read_text())) if f.is_file() else None


def done_paths(folder: Path) -> set[str]:
    """Paths of the images held by the complete shards in ``folder``."""
    done: set[str] = set()
    for path in shard_files(folder):
        with np.load(path, allow_pickle=False) as z:
            done.update(str(v) for v in z["paths"])
    return done


def read_failed(folder: Path) -> dict[str, str]:
    f = Path(folder) / FAILED_FILE
    return dict(json.loads(f.read_text())) if f.is_file() else {}


class ShardWriter:
    """Collects extracted images and writes them ``shard_size`` at a time as new shards in ``folder``.

    The folder's manifest pins the feature settings: opening it with other settings raises ShardError
    (shards of two settings in one folder could not be told apart). Use as a context manager: leaving
    the block writes the last, partial shard and ``failed.json``."""

    def __init__(self, folder: Path, cfg: ImageConfig, shard_size: int = DEFAULT_SHARD_SIZE,
                 embedded_by: str | None = None, dim: int = 0) -> None:
        if shard_size < 1:
            raise ValueError("shard_size must be at least 1")
        if embedded_by is not None and dim < 1:
            raise ValueError("embedded shards need the model's dimension")
        self.folder = Path(folder)
        self.cfg = shard_settings(cfg)
        self.shard_size = shard_size
        self.embedded_by, self.dim = embedded_by, dim
        self.folder.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {**config_payload(self.cfg), "key": config_key(self.cfg)}
        if embedded_by is not None:
            payload.update(embedded_by=embedded_by, dim=dim, key=f"{payload['key']}-{embedded_by}")
        manifest = read_manifest(self.folder)
        if manifest is None:
            with atomic_file(self.folder / MANIFEST_FILE) as fh:
                fh.write(json.dumps(payload, indent=1, sort_keys=True).encode())
        elif manifest.get("key") != payload["key"]:
            raise ShardError(f"{self.folder} holds shards of other feature settings ({manifest.get('image')}); "
                             "use another folder")
        files = shard_files(self.folder)
        self._next = int(SHARD_PATTERN.match(files[-1].name).group(1)) + 1 if files else 0  # type: ignore[union-attr]
        self._failed = read_failed(self.folder)
        self._failed_changed = False
        # key, name, path, fragments, and (embedded shards) each fragment's detector label: () when none
        self._rows: list[tuple[str, str, str, ImageFragments, tuple[str | None, ...]]] = []
        self.written = 0  # images written by this writer
        self.shards: list[Path] = []  # shards written by this writer

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, key: str, name: str, path: str, frags: ImageFragments) -> None:
        """One extracted image; a shard is written once ``shard_size`` images are waiting."""
        self._append(key, name, path, frags, ())

    def add_vectors(self, key: str, name: str, path: str, vectors: np.ndarray, boxes: np.ndarray, width: int,
                    height: int, labels: Sequence[str | None] = ()) -> None:
        """One embedded image (a writer of embedded shards): vectors (F, h), boxes (F, 4), and its fragments'
        detector labels (``EmbeddedImage.labels``: one per fragment, or () when the model has none)."""
        if self.embedded_by is None:
            raise ValueError("this shard folder holds features: add(), not add_vectors()")
        if labels and len(labels) != self.cfg.n_fragments:
            raise ValueError(f"{name}: {len(labels)} labels for {self.cfg.n_fragments} fragments")
        self._append(key, name, path, ImageFragments(boxes, vectors, width, height), tuple(labels))

    def _append(self, key: str, name: str, path: str, frags: ImageFragments, labels: tuple[str | None, ...]) -> None:
        n_frag, width = self.cfg.n_fragments, self.dim if self.embedded_by is not None else feature_dim(self.cfg)
        if frags.features.shape != (n_frag, width) or frags.boxes.shape != (n_frag, 4):
            raise ValueError(f"{name}: fragments {frags.features.shape} / boxes {frags.boxes.shape}, "
                             f"expected {(n_frag, width)} / {(n_frag, 4)}")
        self._rows.append((key, name, path, frags, labels))
        self._failed_changed |= self._failed.pop(name, None) is not None
        if len(self._rows) >= self.shard_size:
            self.flush()

    def add_cached(self, key: str, name: str, path: str, entry: Path) -> None:
        """An image whose fragments are in the feature cache at ``entry``."""
        self.add(key, name, path, read_entry(entry))

    def fail(self, name: str, reason: str) -> None:
        """Record an image that was skipped (unreadable, or extraction failed)."""
        self._failed[name] = reason
        self._failed_changed = True

    def flush(self) -> None:
        """Write the images waiting as one shard (nothing when none wait)."""
        if not self._rows:
            return
        path = self.folder / f"shard-{self._next:05d}.npz"
        keys, names, paths, frags, labels = zip(*self._rows, strict=True)
        arrays: dict[str, np.ndarray] = {
            "keys": np.asarray(keys, dtype=str),
            "names": np.asarray(names, dtype=str),
            "paths": np.asarray(paths, dtype=str),
            "sizes": np.asarray([[f.width, f.height] for f in frags], dtype=np.int64),
            "boxes": np.stack([f.boxes for f in frags]).astype(np.float32),
            "vectors" if self.embedded_by is not None else "features":
                np.stack([f.features for f in frags]).astype(np.float16),
        }
        if any(labels):  # embedded rows of a model with detector classes (rows without: all unnamed)
            n_frag = self.cfg.n_fragments
            arrays["labels"] = np.asarray([[v or "" for v in (row or (None,) * n_frag)] for row in labels], dtype=str)
        with atomic_file(path) as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]  # (the stub reads a key as allow_pickle)
        self.written += len(self._rows)
        self.shards.append(path)
        self._next += 1
        self._rows = []

    def close(self) -> None:
        self.flush()
        if self._failed_changed:
            with atomic_file(self.folder / FAILED_FILE) as fh:
                fh.write(json.dumps(self._failed, indent=1, sort_keys=True).encode())
            self._failed_changed = False


def load_shards(index: ImageIndex, folder: Path, chunk: int = LOAD_CHUNK, progress: bool = True,
                commit_images: int = COMMIT_IMAGES, remove_loaded: bool = False) -> int:
    """Add the images of the shards in ``folder`` that ``index`` does not hold yet (by path) → how many.

    Goes through ``ImageIndex.add`` (the model embeds the features, the index's backend stores them;
    embedded shards' vectors as they are), streamed: ``chunk`` images embedded at a time,
    their vectors appended to the re-rank store (which spills to its folder past
    ``fragsearch.index.store.SPILL_BYTES``) and to the candidate index. A commit (``index.save``) follows every
    ``commit_images`` images and the last shard, so an interrupted load keeps what it committed and
    resumes after it. An untrained ivf / ivfpq index
    takes its first group inside ``index.bulk()``: trained once on a sample of that group, then
    filled as the rest streams in. With ``remove_loaded``, each shard file is deleted once a commit
    holds its images (a load that needs no second copy of the collection on disk)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        raise ShardError(f"{folder} has no {MANIFEST_FILE}: not a shard folder")
    want = config_key(shard_settings(index.bundle.image_cfg))
    embedded_by = manifest.get("embedded_by")
    if embedded_by is not None:
        if embedded_by != index.fingerprint:
            raise ShardError(f"the shards in {folder} hold vectors of another model ({embedded_by}, the index's "
                             f"is {index.fingerprint})")
        want = f"{want}-{embedded_by}"
    if manifest.get("key") != want:
        raise ShardError(f"the shards in {folder} were extracted with other image settings than the model's "
                         f"({manifest.get('image')})")
    if commit_images < 1:
        raise ValueError("commit_images must be at least 1")
    files = shard_files(folder)
    total = sum(len(read_shard_keys(path)) for path in files)
    added = 0
    remaining = iter(files)
    with tqdm(total=total, desc=f"loading {folder.name}", unit="img", disable=not progress) as bar:
        while True:
            group: list[Path] = []
            waiting = 0
            train = index.settings.shape.trainable and not index.candidates.trained
            with index.bulk() if train else contextlib.nullcontext():
                for path in remaining:
                    group.append(path)
                    shard = read_shard(path)
                    waiting += _load_shard(index, shard, chunk)
                    bar.update(len(shard))
                    del shard
                    if waiting >= commit_images:
                        break
            if not group:
                break
            if waiting:
                index.save()
            added += waiting
            if remove_loaded:
                for path in group:
                    path.unlink(missing_ok=True)
    logger.info("loaded %d images from %d shards in %s into %s (%d there already)%s", added, len(files), folder,
                index.root, total - added, "; the loaded shards were removed" if remove_loaded else "")
    return added


def _load_shard(index: ImageIndex, shard: Shard, chunk: int) -> int:
    """Add the images of one shard the index does not hold yet, `chunk` at a time → how many."""
    present = index.photos.find(shard.paths)
    rows = [k for k, p in enumerate(shard.paths) if p not in present]
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        if shard.embedded:
            index.add(embedded_images(shard.features[part].astype(np.float32), shard.boxes[part], shard.sizes[part],
                                      [shard.labels_of(k) for k in part]),
                      [shard.names[k] for k in part], [shard.paths[k] for k in part], read_places=False)
            continue
        index.add([shard.fragments(k) for k in part], [shard.names[k] for k in part], [shard.paths[k] for k in part])
    return len(rows)


def read_shard_keys(path: Path) -> list[str]:
    """The content keys of one shard (its images, without reading their features)."""
    with np.load(path, allow_pickle=False) as z:
        return [str(v) for v in z["keys"]]


def shard_summary(folder: Path) -> dict[str, int]:
    """Counts of a shard folder: shards, images, failed."""
    files = shard_files(folder)
    images = 0
    for path in files:
        images += len(read_shard_keys(path))
    return {"shards": len(files), "images": images, "failed": len(read_failed(folder))}
