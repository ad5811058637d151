"""On-disk image feature cache: one ``.npz`` per image under a folder keyed by the feature settings.

An entry is named by the image's content (a hash of the file's bytes), not by its file name: two
different photos with the same name and size never share features, and a renamed or copied photo
is not extracted again. Entries are written atomically (temp file + fsync + rename), so an interrupted run leaves only
complete entries and the next run resumes with what is missing. Unreadable files are skipped,
counted and listed in ``failed.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from model.atomic import atomic_file, stale_temps
from model.backbone import (
    BACKBONE_NAME,
    CALIBRATION_SEED,
    FEATURE_DIM,
    QUANT_VERSION,
    onnx_graph,
    set_torch_threads,
    weights_digest,
)
from model.config import ImageConfig
from model.image import ImageFragments, RegionExtractor
from model.imageio import ImageReadError, load_image
from model.onnx import graph_dir

logger = logging.getLogger(__name__)

FEATURE_VERSION = 2  # bump when the extraction code changes its output for the same settings
FAILED_FILE = "failed.json"
CONFIG_FILE = "config.json"


def config_payload(cfg: ImageConfig) -> dict[str, Any]:
    """Everything that shapes the features: every ImageConfig field, the backbone (for a fine-tuned one the
    digest of its weights, not their path), the version, and for the int8 backbone its quantization recipe."""
    image = dataclasses.asdict(cfg)
    weights = image.pop("backbone_weights")  # not in the payload for the ImageNet weights: their keys stay
    payload: dict[str, Any] = {"image": image, "backbone": BACKBONE_NAME, "version": FEATURE_VERSION}
    if weights:
        payload["backbone_weights"] = weights_digest(weights)  # the bytes, not the path
    if cfg.backbone_precision == "int8":
        payload["quantization"] = {"version": QUANT_VERSION, "calibration_seed": CALIBRATION_SEED}
    return payload


def config_key(cfg: ImageConfig) -> str:
    """Short hash of `config_payload`: the name of the cache folder for these settings."""
    return hashlib.sha256(json.dumps(config_payload(cfg), sort_keys=True).encode()).hexdigest()[:12]


def content_key(data: bytes) -> str:
    """The name of an image's entry: a hash of its file's bytes."""
    return hashlib.sha256(data).hexdigest()[:32]


def entry_name(item: str | Path) -> str:
    """How an image is named in reports and ``failed.json``: its file name."""
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


def write_entry(path: Path, frag: ImageFragments) -> None:
    """Store one image's fragments (features as float16) atomically."""
    with atomic_file(path) as fh:
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
    with atomic_file(path) as fh:
        fh.write(json.dumps(obj, indent=1, sort_keys=True).encode())


# -- extraction, in-process or in a pool of worker processes -------------------------------------------


def _extract_chunk(
    extractor: RegionExtractor, paths: Sequence[str], out_dir: str | None
) -> tuple[int, list[tuple[str, str]]]:
    """Load, extract and (if out_dir) store a chunk of images → (n extracted, [(name, reason)]).

    With out_dir, each image is stored as ``<out_dir>/<content key>.npz``."""
    failed: list[tuple[str, str]] = []
    good: list[tuple[str, str, Image.Image]] = []
    for p in paths:
        try:
            data = Path(p).read_bytes()
            good.append((entry_name(p), content_key(data), load_image(data, name=str(p))))
        except OSError as e:
            failed.append((entry_name(p), f"{p}: cannot open ({e.strerror or e})"))
        except ImageReadError as e:
            failed.append((entry_name(p), str(e)))
    if not good:
        return 0, failed
    try:
        frags = extractor.extract_batch([img for _, _, img in good])
        results: list[tuple[str, str, ImageFragments | None, str]] = [
            (n, k, f, "") for (n, k, _), f in zip(good, frags, strict=True)
        ]
    except Exception:  # isolate the image that breaks a batch
        results = []
        for n, k, img in good:
            try:
                results.append((n, k, extractor.extract(img), ""))
            except Exception as e:
                results.append((n, k, None, f"feature extraction failed: {type(e).__name__}: {e}"))
    done = 0
    for n, key, frag, reason in results:
        if frag is None:
            failed.append((n, reason))
            continue
        if out_dir is not None:
            write_entry(Path(out_dir) / f"{key}.npz", frag)
        done += 1
    return done, failed


_STOP = None  # sentinel task: the worker exits


def _worker_main(cfg: ImageConfig, device: str, runtime: str, parent: int, warm: Sequence[str],
                 tasks: Any, results: Any) -> None:
    """A pool worker: one torch/OpenCV thread, its own extractor, tasks until the stop sentinel.

    Messages back: ("ready", pid) once warm, ("done", task id, n, failures, CPU seconds) per task,
    ("error", task id, text) when a task raised."""
    set_torch_threads(1)
    extractor = RegionExtractor(cfg, device, runtime)
    if warm:
        _extract_chunk(extractor, warm, None)
    results.put(("ready", os.getpid()))
    while True:
        task = tasks.get()
        if task is _STOP or os.getppid() != parent:  # stopped, or the parent was killed: no orphan work
            return
        tid, paths, out_dir = task
        cpu = time.process_time()
        try:
            done, failed = _extract_chunk(extractor, paths, out_dir)
        except Exception as e:  # reported to the parent, which raises it
            results.put(("error", tid, f"{type(e).__name__}: {e}"))
            continue
        results.put(("done", tid, done, failed, time.process_time() - cpu))


class ExtractionPool:
    """Runs RegionExtractor over image files, in this process (workers=1) or in worker processes.

    Each worker process uses 1 torch/OpenCV thread and holds its own extractor (no module state);
    use as a context manager. ``cpu_seconds`` adds up the CPU time spent extracting (all workers),
    a load-independent cost. ``runtime`` is the backbone's (``model/backbone.py``).
    """

    POLL_S = 1.0  # how often a waiting parent checks that its workers are alive

    def __init__(self, cfg: ImageConfig, device: str = "cpu", workers: int = 1, runtime: str = "auto") -> None:
        self.cfg = cfg
        self.device = device
        self.runtime = runtime
        self.workers = max(1, workers)
        self._local: RegionExtractor | None = None
        self._procs: list[Any] = []
        self._tasks: Any = None
        self._results: Any = None
        self.cpu_seconds = 0.0

    def __enter__(self) -> ExtractionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (they finish the task at hand), then reap them."""
        if not self._procs:
            return
        for _ in self._procs:
            self._tasks.put(_STOP)
        for proc in self._procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._procs = []

    def _start(self, warm: Sequence[str] = ()) -> None:
        if self._procs:
            return
        # made once here, not by every worker at once
        onnx_graph(self.cfg.backbone_precision, graph_dir())
        if self.cfg.backbone_weights:
            onnx_graph(self.cfg.backbone_precision, graph_dir(), weights=self.cfg.backbone_weights)
        ctx = multiprocessing.get_context("spawn")
        self._tasks, self._results = ctx.Queue(), ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker_main, daemon=True,
                        args=(self.cfg, self.device, self.runtime, os.getpid(), list(warm), self._tasks, self._results))
            for _ in range(self.workers)
        ]
        for proc in self._procs:
            proc.start()
        ready = 0
        while ready < self.workers:
            if self._message()[0] == "ready":
                ready += 1

    def _message(self) -> tuple[Any, ...]:
        """The next message from a worker; raises if a worker died instead of answering."""
        while True:
            try:
                return tuple(self._results.get(timeout=self.POLL_S))
            except queue.Empty:
                dead = [p for p in self._procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"an extraction worker exited with code {dead[0].exitcode}") from None

    def warm_up(self, paths: Sequence[Path]) -> None:
        """Start every worker (model loaded) and extract ``paths`` once in each, unstored."""
        chunk = [str(p) for p in paths]
        if self.workers == 1:
            _extract_chunk(self._extractor(), chunk, None)
            return
        self._start(chunk)

    def _extractor(self) -> RegionExtractor:
        if self._local is None:
            self._local = RegionExtractor(self.cfg, self.device, self.runtime)
        return self._local

    def run(
        self, paths: Sequence[Path], batch: int = 8, out_dir: Path | None = None, progress: bool = True,
        desc: str = "features",
    ) -> tuple[int, list[tuple[str, str]]]:
        """Extract every path (storing ``<out_dir>/<content key>.npz`` when out_dir is given)
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
                self._start()
                for tid, chunk in enumerate(chunks):
                    self._tasks.put((tid, chunk, target))
                remaining = len(chunks)
                while remaining:
                    msg = self._message()
                    if msg[0] == "error":
                        raise RuntimeError(f"feature extraction failed in a worker: {msg[2]}")
                    if msg[0] != "done":
                        continue
                    remaining -= 1
                    _, tid, n, bad, cpu = msg
                    self.cpu_seconds += cpu
                    done, failed = done + n, failed + list(map(tuple, bad))
                    bar.update(len(chunks[tid]))
        finally:
            bar.close()
        return done, failed


# -- the cache ------------------------------------------------------------------------------------


class FeatureCache:
    """Image fragments cached under ``root / config_key(cfg)``, one ``<content key>.npz`` per image.

    Images are given as paths; their content keys are remembered per (path, size, mtime)."""

    def __init__(self, root: Path, cfg: ImageConfig, device: str = "cpu", runtime: str = "auto") -> None:
        self.root = Path(root)
        self.cfg = cfg
        self.device = device
        self.runtime = runtime
        self.dir = self.root / config_key(cfg)
        self._keys: dict[tuple[str, int, int], str] = {}

    def key(self, path: str | Path) -> str:
        """The content key of the image file at ``path`` (OSError if it cannot be read)."""
        st = os.stat(path)
        memo = (str(path), st.st_size, st.st_mtime_ns)
        key = self._keys.get(memo)
        if key is None:
            key = self._keys[memo] = content_key(Path(path).read_bytes())
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
            _write_json(self.dir / CONFIG_FILE, config_payload(self.cfg))
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
                                self.runtime) as pool:
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

    def load_arrays(self, images: Sequence[str | Path]) -> tuple[np.ndarray, np.ndarray]:
        """→ features (N, F, 1280) float32, boxes (N, F, 4) float32, in the order of ``images``."""
        n_frag = self.cfg.n_fragments
        feats = np.empty((len(images), n_frag, FEATURE_DIM), dtype=np.float32)
        boxes = np.empty((len(images), n_frag, 4), dtype=np.float32)
        for k, image in enumerate(images):
            with np.load(self._existing(image)) as z:
                f, b = z["features"], z["boxes"]
                if f.shape != (n_frag, FEATURE_DIM):
                    raise ValueError(f"{entry_name(image)}: cached features {f.shape}, "
                                     f"expected {(n_frag, FEATURE_DIM)}")
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
