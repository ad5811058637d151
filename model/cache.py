"""On-disk image feature cache: one ``.npz`` per image under a folder keyed by the feature settings.

Entries are written atomically (temp file + fsync + rename), so an interrupted run leaves only
complete entries and the next run resumes with what is missing. Unreadable files are skipped,
counted and listed in ``failed.json``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from model.config import ImageConfig
from model.image import (
    BACKBONE_NAME,
    FEATURE_DIM,
    ImageFragments,
    ImageReadError,
    RegionExtractor,
    load_image,
    set_torch_threads,
)

logger = logging.getLogger(__name__)

FEATURE_VERSION = 1  # bump when the extraction code changes its output for the same settings
FAILED_FILE = "failed.json"
CONFIG_FILE = "config.json"
TMP_SUFFIX = ".tmp"


def config_key(cfg: ImageConfig) -> str:
    """Short hash of every ImageConfig field (all of them shape the features) + backbone + version."""
    payload = {"image": dataclasses.asdict(cfg), "backbone": BACKBONE_NAME, "version": FEATURE_VERSION}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def entry_name(item: str | Path) -> str:
    """Cache key of an image: its file name (a path or a bare name both work)."""
    name = Path(item).name
    if name in ("", ".", ".."):
        raise ValueError(f"not a usable image name: {item!r}")
    return name


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


# -- atomic file writes ----------------------------------------------------------------------------


@contextlib.contextmanager
def _atomic_target(path: Path) -> Iterator[Any]:
    """Yield a binary file handle; on success it is fsynced and renamed onto ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{os.getpid()}.{path.name}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_entry(path: Path, frag: ImageFragments) -> None:
    """Store one image's fragments (features as float16) atomically."""
    with _atomic_target(path) as fh:
        np.savez(
            fh,
            boxes=frag.boxes.astype(np.float32),
            features=frag.features.astype(np.float16),
            size=np.asarray([frag.width, frag.height], dtype=np.int64),
        )


def read_entry(path: Path) -> ImageFragments:
    """One cached entry back as ImageFragments (features float32)."""
    with np.load(path) as z:
        width, height = (int(v) for v in z["size"])
        return ImageFragments(z["boxes"].astype(np.float32), z["features"].astype(np.float32), width, height)


def _write_json(path: Path, obj: object) -> None:
    with _atomic_target(path) as fh:
        fh.write(json.dumps(obj, indent=1, sort_keys=True).encode())


# -- extraction, in-process or in a pool of worker processes -------------------------------------------

_worker_extractor: RegionExtractor | None = None
_worker_parent: int | None = None


def _init_worker(cfg: ImageConfig, device: str, parent: int) -> None:
    global _worker_extractor, _worker_parent
    set_torch_threads(1)
    _worker_parent = parent
    _worker_extractor = RegionExtractor(cfg, device)


def _extract_chunk(
    extractor: RegionExtractor, paths: Sequence[str], out_dir: str | None
) -> tuple[int, list[tuple[str, str]]]:
    """Load, extract and (if out_dir) store a chunk of images → (n extracted, [(name, reason)])."""
    failed: list[tuple[str, str]] = []
    good: list[tuple[str, Image.Image]] = []
    for p in paths:
        try:
            good.append((entry_name(p), load_image(Path(p))))
        except ImageReadError as e:
            failed.append((entry_name(p), str(e)))
    if not good:
        return 0, failed
    try:
        frags = extractor.extract_batch([img for _, img in good])
        results: list[tuple[str, ImageFragments | None, str]] = [
            (n, f, "") for (n, _), f in zip(good, frags, strict=True)
        ]
    except Exception:  # isolate the image that breaks a batch
        results = []
        for n, img in good:
            try:
                results.append((n, extractor.extract(img), ""))
            except Exception as e:
                results.append((n, None, f"feature extraction failed: {type(e).__name__}: {e}"))
    done = 0
    for n, frag, reason in results:
        if frag is None:
            failed.append((n, reason))
            continue
        if out_dir is not None:
            write_entry(Path(out_dir) / f"{n}.npz", frag)
        done += 1
    return done, failed


def _run_chunk(paths: Sequence[str], out_dir: str | None) -> tuple[int, list[tuple[str, str]], float]:
    """Pool task → (n extracted, failures, CPU seconds this worker spent on it)."""
    assert _worker_extractor is not None, "worker not initialised"
    if os.getppid() != _worker_parent:  # the parent was killed: do not keep working as an orphan
        os._exit(1)
    cpu = time.process_time()
    done, failed = _extract_chunk(_worker_extractor, paths, out_dir)
    return done, failed, time.process_time() - cpu


def _worker_pid() -> int:
    time.sleep(0.05)  # long enough for the other workers to take a task too
    return os.getpid()


class ExtractionPool:
    """Runs RegionExtractor over image files, in this process (workers=1) or in a process pool.

    Each pool worker uses 1 torch/OpenCV thread and its own extractor; use as a context manager.
    ``cpu_seconds`` adds up the CPU time spent extracting (all workers), a load-independent cost.
    """

    def __init__(self, cfg: ImageConfig, device: str = "cpu", workers: int = 1) -> None:
        self.cfg = cfg
        self.device = device
        self.workers = max(1, workers)
        self._local: RegionExtractor | None = None
        self._pool: cf.ProcessPoolExecutor | None = None
        self.cpu_seconds = 0.0

    def __enter__(self) -> ExtractionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.cfg, self.device, os.getpid()),
            )
        return self._pool

    def warm_up(self, paths: Sequence[Path]) -> None:
        """Start every worker (model loaded) by extracting ``paths`` once per worker, unstored."""
        chunk = [str(p) for p in paths]
        if self.workers == 1:
            _extract_chunk(self._extractor(), chunk, None)
            return
        futures = [self._executor().submit(_run_chunk, chunk, None) for _ in range(self.workers)]
        for f in futures:
            f.result()
        pids: set[int] = set()
        deadline = time.monotonic() + 300
        while len(pids) < self.workers and time.monotonic() < deadline:  # every worker initialised
            batch = [self._executor().submit(_worker_pid) for _ in range(self.workers)]
            pids.update(f.result() for f in batch)

    def _extractor(self) -> RegionExtractor:
        if self._local is None:
            self._local = RegionExtractor(self.cfg, self.device)
        return self._local

    def run(
        self, paths: Sequence[Path], batch: int = 8, out_dir: Path | None = None, progress: bool = True,
        desc: str = "features",
    ) -> tuple[int, list[tuple[str, str]]]:
        """Extract every path (storing ``<out_dir>/<name>.npz`` when out_dir is given)
        → (n extracted, [(name, reason)] for skipped files)."""
        chunks = [[str(p) for p in paths[i : i + batch]] for i in range(0, len(paths), max(1, batch))]
        target = None if out_dir is None else str(out_dir)
        done = 0
        failed: list[tuple[str, str]] = []
        bar = tqdm(total=len(paths), desc=desc, unit="img", disable=not progress, smoothing=0.1)
        try:
            if self.workers == 1 or len(chunks) <= 1:
                extractor = self._extractor()
                for chunk in chunks:
                    cpu = time.process_time()
                    n, bad = _extract_chunk(extractor, chunk, target)
                    self.cpu_seconds += time.process_time() - cpu
                    done, failed = done + n, failed + bad
                    bar.update(len(chunk))
            else:
                futures = {self._executor().submit(_run_chunk, chunk, target): len(chunk) for chunk in chunks}
                for fut in cf.as_completed(futures):
                    n, bad, cpu = fut.result()
                    self.cpu_seconds += cpu
                    done, failed = done + n, failed + bad
                    bar.update(futures[fut])
        finally:
            bar.close()
        return done, failed


# -- the cache ------------------------------------------------------------------------------------


class FeatureCache:
    """Image fragments cached under ``root / config_key(cfg)``, one ``<image name>.npz`` per image."""

    def __init__(self, root: Path, cfg: ImageConfig, device: str = "cpu") -> None:
        self.root = Path(root)
        self.cfg = cfg
        self.device = device
        self.dir = self.root / config_key(cfg)

    def path(self, name: str | Path) -> Path:
        return self.dir / f"{entry_name(name)}.npz"

    def has(self, name: str | Path) -> bool:
        """True once the image's entry is complete on disk (temp files do not count)."""
        return self.path(name).is_file()

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
            _write_json(self.dir / CONFIG_FILE, {"image": dataclasses.asdict(self.cfg), "backbone": BACKBONE_NAME,
                                                 "version": FEATURE_VERSION})
        todo: list[Path] = []
        seen: set[str] = set()
        reused = 0
        for p in paths:
            name = entry_name(p)
            if name in seen:
                continue
            seen.add(name)
            if self.has(name):
                reused += 1
            else:
                todo.append(Path(p))
        extracted = 0
        failed: list[tuple[str, str]] = []
        if todo:
            logger.info("extracting %d images (%d cached) into %s with %d worker(s)",
                        len(todo), reused, self.dir, workers)
            with ExtractionPool(self.cfg, self.device, min(workers, max(1, len(todo) // max(1, batch)))) as pool:
                extracted, failed = pool.run(todo, batch=batch, out_dir=self.dir, progress=progress)
        self._record_failures([entry_name(p) for p in todo], failed)
        for name, reason in failed:
            logger.warning("skipped %s: %s", name, reason)
        report = CacheReport(extracted, reused, sorted(failed), time.perf_counter() - start)
        if extracted:
            logger.info("extracted %d images in %.1f s (%.1f images/s), %d skipped",
                        extracted, report.seconds, report.images_per_s, len(failed))
        return report

    def load(self, names: Sequence[str | Path]) -> list[ImageFragments]:
        """Cached fragments of each image (features float32); KeyError if one is missing."""
        return [read_entry(self._existing(n)) for n in names]

    def load_arrays(self, names: Sequence[str | Path]) -> tuple[np.ndarray, np.ndarray]:
        """→ features (N, F, 1280) float32, boxes (N, F, 4) float32, in the order of ``names``."""
        n_frag = self.cfg.n_fragments
        feats = np.empty((len(names), n_frag, FEATURE_DIM), dtype=np.float32)
        boxes = np.empty((len(names), n_frag, 4), dtype=np.float32)
        for k, name in enumerate(names):
            with np.load(self._existing(name)) as z:
                f, b = z["features"], z["boxes"]
                if f.shape != (n_frag, FEATURE_DIM):
                    raise ValueError(f"{entry_name(name)}: cached features {f.shape}, expected {(n_frag, FEATURE_DIM)}")
                feats[k] = f
                boxes[k] = b
        return feats, boxes

    # -- internals ---------------------------------------------------------------------------------

    def _existing(self, name: str | Path) -> Path:
        path = self.path(name)
        if not path.is_file():
            raise KeyError(f"{entry_name(name)} is not in the feature cache {self.dir}")
        return path

    def _record_failures(self, attempted: Sequence[str], failed: Sequence[tuple[str, str]]) -> None:
        known = self.failed()
        tried = set(attempted)
        merged = {n: r for n, r in known.items() if n not in tried and not self.has(n)}
        merged.update(dict(failed))
        if merged != known:
            _write_json(self.dir / FAILED_FILE, merged)

    def _remove_stale_temps(self) -> None:
        """Delete temp files left by writers that no longer run (an interrupted earlier run)."""
        for tmp in self.dir.glob(f".*{TMP_SUFFIX}"):
            field_ = tmp.name.split(".")[1]  # ".<pid>.<name>.<random>.tmp"
            pid = int(field_) if field_.isdigit() else None
            if pid is not None and (pid == os.getpid() or _alive(pid)):
                continue  # still being written
            with contextlib.suppress(OSError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
