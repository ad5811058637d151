"""Extracting image files into feature-cache entries: in this process, or in a pool of worker processes
(one ONNX Runtime/OpenCV thread and one extractor each), with failures reported per image."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fragsearch.model.config import ImageConfig
from fragsearch.model.device import extraction_device
from fragsearch.model.features import PhotoReader, entry_name, write_entry
from fragsearch.model.image import ImageFragments, RegionExtractor, extractor_files
from fragsearch.model.imageio import ImageReadError, Photo
from fragsearch.model.onnx import set_threads
from fragsearch.model.places import Places


def _extract_chunk(
    extractor: RegionExtractor, paths: Sequence[str], out_dir: str | None
) -> tuple[int, list[tuple[str, str]]]:
    """Load, extract and (if out_dir) store a chunk of images → (n extracted, [(name, reason)]).

    With out_dir, each image is stored as ``<out_dir>/<content key>.npz``."""
    failed: list[tuple[str, str]] = []
    good: list[tuple[str, str, Photo]] = []
    reader = PhotoReader.of(extractor.cfg)
    for p in paths:
        try:
            data = Path(p).read_bytes()
            good.append((entry_name(p), reader.key(data), reader.read(data, name=str(p))))
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


def _worker_main(cfg: ImageConfig, device: str, runtime: str, places: Places, parent: int, warm: Sequence[str],
                 tasks: Any, results: Any) -> None:
    """A pool worker's loop: one ONNX Runtime/OpenCV thread, its own extractor (its files where the parent's
    `places` say), tasks until the stop sentinel.

    Messages back: ("ready", pid) once warm, ("done", task id, n, failures, CPU seconds) per task,
    ("error", task id, text) when a task raised."""
    set_threads(1)
    extractor = RegionExtractor(cfg, device, runtime, places)
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

    Each worker process uses 1 ONNX Runtime/OpenCV thread and holds its own extractor (no module state);
    use as a context manager. ``cpu_seconds`` adds up the CPU time spent extracting (all workers),
    a load-independent cost. ``runtime`` is the backbone's (``model/backbone.py``); ``places``, where the files
    of this process and its workers are (model/places.py: the command's, passed on to the spawned workers). The
    worker processes run on the device ``fragsearch.model.device.extraction_device`` chooses (the CPU); this
    process's own extractor (one worker, or a single chunk) on ``device``.
    """

    POLL_S = 1.0  # how often a waiting parent checks that its workers are alive

    def __init__(self, cfg: ImageConfig, device: str = "cpu", workers: int = 1, runtime: str = "auto",
                 places: Places | None = None) -> None:
        self.cfg = cfg
        self.places = places or Places()
        self.device = device
        self.runtime = runtime
        self.workers = max(1, workers)
        self._local: RegionExtractor | None = None
        self._procs: list[Any] = []
        self._tasks: Any = None
        self._results: Any = None
        self.cpu_seconds = 0.0

    @property
    def worker_device(self) -> str:
        """The device of the worker processes (model.device.extraction_device)."""
        return extraction_device(self.device, self.workers)

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
        extractor_files(self.cfg, self.places)  # found or made once here, not by every worker at once
        ctx = multiprocessing.get_context("spawn")
        self._tasks, self._results = ctx.Queue(), ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker_main, daemon=True,
                        args=(self.cfg, self.worker_device, self.runtime, self.places, os.getpid(), list(warm),
                              self._tasks, self._results))
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
            self._local = RegionExtractor(self.cfg, self.device, self.runtime, self.places)
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
