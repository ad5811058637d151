"""The embedded default's preparation: train the model and build the two indexes if missing.

What exists is reused: a checkpoint is never retrained, a finished index built with this
checkpoint is loaded as it is, and an image index left half-built by an interrupted run is extended
with the images it lacks. An index built with another checkpoint (the model was retrained or
replaced), or whose candidates are in another backend than FRAGSEARCH_INDEX_BACKEND names (faiss, milvus),
is set aside as `<name>.stale` and rebuilt from the cached features and caption vectors; the stale copy is
removed once the new one is complete. FRAGSEARCH_INDEX_BACKEND=milvus in an installation without the
Milvus client stops at once with one line naming the fix.

The service prepares in a child process (`Apart`): what building the indexes holds (the caption vectors,
MiniLM's arenas, the extraction workers' results) goes back with it, so a first start ends holding what a
restart holds. The child reports its stages, its progress bars and the moment the image index is ready.

Progress (`Progress`): the stage being prepared and, from the live progress bar of the step under
way (feature extraction, training epochs, indexing), the items done, the total and the estimated
time left. The service reports it on GET /readyz while it prepares; `python -m fragsearch.service.prepare`
(the one-shot preparation a container runs before the service) writes it to the log.

    python -m fragsearch.service.prepare [--config FILE] [--SETTING VALUE ...]

The settings are the service's, read the same way: a flag for every setting (`--help` lists them,
docs/operations/settings.md is their table) over the FRAGSEARCH_* environment variables, `.env` and
the settings file (./fragsearch.toml, FRAGSEARCH_CONFIG or --config): fragsearch/commands/options.py.

Its command line: fragsearch/commands/prepare.py (`python -m fragsearch.service.prepare` calls it).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fragsearch.index.backends import require_milvus
from fragsearch.index.build import build_image_index, write_sentence_index
from fragsearch.index.catalogue import is_index, set_aside_if_stale
from fragsearch.index.fingerprint import model_fingerprint
from fragsearch.index.sentences import DEFAULT_SETTINGS as SENTENCE_DEFAULTS
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import DataError, Split, load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.device import device_name
from fragsearch.model.release import RELEASE_DIR, RELEASED_MODEL, is_released
from fragsearch.service import logs
from fragsearch.service.collection import new_index_settings, sync_collection
from fragsearch.settings import Settings

logger = logging.getLogger("fragsearch.service.prepare")  # the same name when run as its own __main__

class ModelMissing(FileNotFoundError):
    """The checkpoint to serve is not there and nothing is set to train it."""


def _partial_marker(root: Path) -> Path:
    """Present beside an image index while its build is unfinished (it is saved every few thousand images)."""
    return root.parent / (root.name + ".partial")


def image_index_ready(root: Path) -> bool:
    return is_index(root) and not _partial_marker(root).exists()


STAGES = ("model", "image index", "sentence index", "loading")


class Progress:
    """What is being prepared: the stage, and the items done / total of the step under way.

    The step's counts come from the newest live progress bar (tqdm) of this process: extraction,
    training epochs and indexing all draw one, so every long step is covered by one mechanism."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.stage = "starting"
        self.detail = ""
        self.done_stages: list[str] = []
        self.finished = False
        self._lock = threading.Lock()
        self._followed: dict[str, Any] | None = None  # the bar of a child process preparing (`Apart`)

    def enter(self, stage: str, detail: str = "", log: bool = True) -> None:
        """Stage `stage` starts (`log`: say so in the log; a stage a child process logged is not said twice)."""
        with self._lock:
            if self.stage in STAGES and self.stage not in self.done_stages:
                self.done_stages.append(self.stage)
            self.stage, self.detail = stage, detail
            self._followed = None
        if log:
            logger.info("preparing: %s%s", stage, f" ({detail})" if detail else "")

    def follow(self, bar: dict[str, Any] | None) -> None:
        """The step under way is another process's: its bar as `bar_state` reads it (None: no bar)."""
        with self._lock:
            self._followed = bar

    def finish(self) -> None:
        with self._lock:
            self.finished = True
            self.stage, self.detail = "ready", ""

    def _left(self) -> list[str]:
        """The stages after the current one (all of them before the first)."""
        if self.finished:
            return []
        after = STAGES.index(self.stage) + 1 if self.stage in STAGES else 0
        return list(STAGES[after:])

    @staticmethod
    def _bar() -> Any | None:
        """The newest live tqdm bar with a total, or None."""
        try:
            with tqdm.get_lock():
                bars = [b for b in list(getattr(tqdm, "_instances", ())) if b.total and not b.disable]
        except (RuntimeError, AttributeError):
            return None
        return max(bars, key=lambda b: b.start_t, default=None)

    @staticmethod
    def bar_state() -> dict[str, Any] | None:
        """This process's newest live bar: step (its label), done, total, elapsed seconds; None without one."""
        bar = Progress._bar()
        if bar is None:
            return None
        return {"step": str(bar.desc).rstrip(": ") or None, "done": int(bar.n), "total": int(bar.total),
                "elapsed": float(bar.format_dict.get("elapsed", 0.0))}

    def snapshot(self) -> dict[str, Any]:
        """stage, detail, step (the bar's label), done, total, eta_seconds (None when unknown), elapsed."""
        with self._lock:
            out: dict[str, Any] = {"stage": self.stage, "detail": self.detail, "step": None, "done": None,
                                   "total": None, "eta_seconds": None,
                                   "elapsed_seconds": round(time.monotonic() - self.started, 1),
                                   "stages_done": list(self.done_stages), "stages_left": self._left()}
            followed = self._followed
        bar = None if self.finished else followed or self.bar_state()
        if bar is not None:
            done, total, elapsed = bar["done"], bar["total"], bar["elapsed"]
            out.update(step=bar["step"], done=done, total=total,
                       eta_seconds=round(elapsed * (total - done) / done, 1) if done > 0 else None)
        return out

    def line(self) -> str:
        s = self.snapshot()
        parts = [f"preparing {s['stage']}"]
        if s["step"] or s["total"]:
            parts.append(f"{s['step'] or 'step'} {s['done']}/{s['total']}")
        if s["eta_seconds"] is not None:
            parts.append(f"about {s['eta_seconds'] / 60:.1f} min left in this step")
        parts.append(f"{s['elapsed_seconds'] / 60:.1f} min so far")
        return ", ".join(parts)


def _limited(split: Split, settings: Settings) -> Split:
    return split if settings.limit is None else split.subset(settings.limit)


def ensure_model(settings: Settings) -> Path:
    """The checkpoint served (model/release.py: the released model unless a model or a variant is set).

    Only a named variant's missing checkpoint is trained (training.train.train_variant, on every training
    image for the variant's fixed epoch count; a variant with members trains each so and merges them),
    the training package imported only then. The released model is never trained here: a missing one is
    an error that says how to restore it."""
    path = settings.model_path
    if path.is_file():
        logger.info("model: %s %s", "serving the released model" if is_released(path) else "reusing", path)
        return path
    if settings.variant is None:
        raise ModelMissing(
            f"no model at {path}: " + (f"the released model is missing from the checkout (git checkout -- "
                                       f"{RELEASE_DIR} restores it)" if path == RELEASED_MODEL else
                                       "set FRAGSEARCH_MODEL_PATH to a checkpoint (./run train --variant V makes "
                                       "one) or leave it unset to serve the released model"))
    logger.info("model: %s is missing; training the %r variant on %s (features are extracted and cached "
                "on first use; this takes a while on a CPU)", path, settings.variant, settings.data)
    from fragsearch.training.train import train_variant  # training code only when there is a model to train

    t0 = time.perf_counter()
    trained = train_variant(settings.variant, settings.data, path.parent, "last", cache=settings.cache,
                            workers=settings.worker_count, device=device_name(settings.device), limit=settings.limit,
                            places=settings.places)
    if not path.is_file():
        raise RuntimeError(f"training finished but wrote no checkpoint at {path}")
    kept = (f"{len(trained.member_epochs)} members merged, epochs {list(trained.member_epochs)} of {trained.epochs} "
            "kept" if trained.member_epochs else f"epoch {trained.epoch} of {trained.epochs} kept")
    logger.info("model: trained in %.0fs (%s)", time.perf_counter() - t0, kept)
    return path


def ensure_image_index(settings: Settings, bundle: Bundle) -> Path:
    """The image index of the settings.image_split images (features from the shared cache), or of the
    settings.collection folder, synced with it at every start."""
    target = settings.image_index
    if settings.mode == "collection":
        sync_collection(settings, bundle)
        return target
    if image_index_ready(target):
        logger.info("image index: reusing %s", target)
        return target
    split = _limited(load_split(settings.data, settings.image_split), settings)
    logger.info("image index: indexing %d %s images into %s", len(split.images), settings.image_split, target)
    t0 = time.perf_counter()
    marker = _partial_marker(target)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    cache = feature_cache(settings.cache, bundle.image_cfg, device=str(bundle.device), artifacts=settings.artifacts)
    index = build_image_index(bundle, [split.image_path(n) for n in split.images], target,
                              new_index_settings(settings), cache=cache, workers=settings.worker_count,
                              collection_root=settings.data, backend=settings.backend)
    marker.unlink()
    logger.info("image index: %d images in %.0fs", len(index), time.perf_counter() - t0)
    index.close()
    return target


def read_sentences(path: Path) -> list[str]:
    """The sentences of a caption file: one a line, or `<image>#<n><TAB><caption>` lines (captions.txt);
    blank lines skipped. DataError when the file is missing or holds none."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"caption file {path} cannot be read as UTF-8 text: {e}") from e
    sentences = [line.split("\t", 1)[-1].strip() for line in lines]
    sentences = [t for t in sentences if t]
    if not sentences:
        raise DataError(f"caption file {path} holds no sentence")
    return sentences


def ensure_sentence_index(settings: Settings, bundle: Bundle) -> Path | None:
    """The sentence collection: the caption file's sentences (settings.captions), else the captions of the
    settings.sentence_split images; None when neither exists (a photo collection served without a data
    folder: /annotate answers that it needs one)."""
    target = settings.sentence_index
    if is_index(target):
        logger.info("sentence index: reusing %s", target)
        return target
    if not settings.has_sentences:
        logger.info("sentence index: no caption file (FRAGSEARCH_CAPTIONS) and no data folder at %s: "
                    "/annotate is unavailable, every other route is served", settings.data)
        return None
    if settings.captions is not None:
        sentences = read_sentences(settings.captions)
        source = str(settings.captions)
    else:
        split = _limited(load_split(settings.data, settings.sentence_split), settings)
        sentences, _ = split.sentences()
        source = f"{settings.sentence_split} captions"
    logger.info("sentence index: %d sentences (%s) into %s", len(sentences), source, target)
    t0 = time.perf_counter()
    # written, not loaded: the service's process loads it (a load here took ~4 s of 30,000 captions' first start)
    write_sentence_index(bundle, sentences, target, new_index_settings(settings, SENTENCE_DEFAULTS),
                         parse_dir=settings.cache / "parses", rebuild=target.exists(),
                         vectors_dir=settings.cache / "vectors", backend=settings.backend)
    logger.info("sentence index: %d sentences in %.0fs", len(sentences), time.perf_counter() - t0)
    return target


def _set_aside_if_stale(root: Path, fingerprint: str, backend: str) -> Path | None:
    """`set_aside_if_stale`, and the unfinished build's marker of the folder set aside removed."""
    stale = set_aside_if_stale(root, fingerprint, backend)
    if stale is not None:
        _partial_marker(root).unlink(missing_ok=True)
    return stale


class BackendMissing(ImportError):
    """The candidate backend set needs a client this installation lacks."""


def check_backend(settings: Settings) -> None:
    """BackendMissing naming the fix when the backend set needs a client this installation lacks (the image
    built without the milvus extra, or `pip install .` without it)."""
    if settings.index_backend != "milvus":
        return
    try:
        require_milvus("FRAGSEARCH_INDEX_BACKEND=milvus")
    except ImportError as e:
        if settings.data_mounted_from is None:  # not in a container compose started: the pip extra
            raise BackendMissing(str(e)) from e
        raise BackendMissing("FRAGSEARCH_INDEX_BACKEND=milvus needs the Milvus client, which this image lacks: "
                          "build it with the milvus extra (docker compose up --build with "
                          "FRAGSEARCH_INDEX_BACKEND=milvus set, or --build-arg INDEX_BACKEND=milvus)") from e


def prepare(settings: Settings, progress: Progress | None = None,
            on_images: Callable[[], None] | None = None) -> float:
    """Make sure the model and both indexes (built with that model) exist; returns the seconds spent.

    `progress` follows the stages; `on_images` is called once the image index is ready (before the
    sentence index is built), so that a service can answer searches while the rest is prepared."""
    progress = progress or Progress()
    t0 = time.perf_counter()
    check_backend(settings)
    progress.enter("model", "training it: features first, then the epochs"
                   if not settings.model_path.is_file() and settings.variant is not None else "loading the checkpoint")
    ensure_model(settings)
    bundle = Bundle.load(settings.model_path, device=settings.device, places=settings.places)
    fingerprint = model_fingerprint(bundle)
    stale = [p for p in (_set_aside_if_stale(settings.image_index, fingerprint, settings.index_backend),
                         _set_aside_if_stale(settings.sentence_index, fingerprint, settings.index_backend))
             if p is not None]
    progress.enter("image index")
    ensure_image_index(settings, bundle)
    if on_images is not None:
        on_images()
    progress.enter("sentence index")
    ensure_sentence_index(settings, bundle)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    seconds = time.perf_counter() - t0
    logger.info("preparation took %.1fs", seconds)
    return seconds


class PreparationFailed(RuntimeError):
    """The child process preparing failed: `str()` is its error as the service reports one (``Type: message``),
    `trace` the child's traceback ("" where it ended without one)."""

    def __init__(self, message: str, trace: str = "") -> None:
        super().__init__(message)
        self.trace = trace


class PreparationStopped(PreparationFailed):
    """`Apart.stop` ended the preparation (the service is stopping)."""


class _Relayed(Progress):
    """The child's progress: each stage also sent to the service's process."""

    def __init__(self, events: Any) -> None:
        super().__init__()
        self._events = events

    def enter(self, stage: str, detail: str = "", log: bool = True) -> None:
        super().enter(stage, detail, log)
        self._events.put(("enter", stage, detail))


def _prepare_in_child(settings: Settings, events: Any, parent: int) -> None:
    """The child process's body: prepare() with the settings it was given, every stage, bar and the moment the
    image index is ready sent on `events`, then ("done", seconds) or ("failed", "Type: message", traceback).
    It ends when the service's process (`parent`) does."""
    logs.configure(settings.log_level, settings.log_format)
    # `Apart.stop` (SIGTERM): end as an exception would, so that what it started ends with it (the extraction
    # workers, a milvus-lite server: their finalizers run) instead of being left behind
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    stop = threading.Event()

    def relay_bars() -> None:
        last: dict[str, Any] | None = None
        while not stop.wait(0.5):
            if os.getppid() != parent:  # the service is gone: nobody reads what this builds
                os._exit(1)
            bar = Progress.bar_state()
            if bar != last:
                events.put(("bar", bar))
                last = bar

    threading.Thread(target=relay_bars, name="prepare-relay", daemon=True).start()
    try:
        seconds = prepare(settings, _Relayed(events), on_images=lambda: events.put(("images",)))
    except BaseException as e:  # reported by the service (/readyz, its log)
        events.put(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    finally:
        stop.set()
    events.put(("done", seconds))


class Apart:
    """prepare() in a child process of its own (spawned: nothing of the service's state is shared). `run` blocks
    until it is done, following its stages on `progress` and calling `on_images` in this process when the
    image index is ready; `stop` ends it (the service stopping while it prepares)."""

    def __init__(self) -> None:
        self._child: Any = None
        self._stopped = threading.Event()

    def run(self, settings: Settings, progress: Progress, on_images: Callable[[], None] | None = None) -> float:
        context = multiprocessing.get_context("spawn")
        events = context.Queue()
        child = context.Process(target=_prepare_in_child, args=(settings, events, os.getpid()),
                                name="fragsearch-prepare")
        child.start()
        self._child = child
        if self._stopped.is_set():  # stopped while it started
            self.stop()
        done = False
        try:
            while True:
                try:
                    event = events.get(timeout=1.0)
                except queue.Empty:
                    if self._stopped.is_set():
                        raise PreparationStopped("the service stopped while preparing") from None
                    if not child.is_alive():
                        raise PreparationFailed(f"the preparation ended without a word (exit status "
                                                f"{child.exitcode})") from None
                    continue
                if event[0] == "enter":
                    progress.enter(event[1], event[2], log=False)
                elif event[0] == "bar":
                    progress.follow(event[1])
                elif event[0] == "images" and on_images is not None:
                    on_images()
                elif event[0] == "done":
                    seconds: float = event[1]
                    done = True
                    return seconds
                elif event[0] == "failed":
                    raise PreparationFailed(event[1], event[2])
        finally:
            if done:  # its last word said: it is ending
                child.join(timeout=60)
            self.stop()  # anything else (loading what it built failed here, or its own failure): no waiting for it
            events.close()

    @property
    def pid(self) -> int | None:
        """The child's process id (None before it started)."""
        return None if self._child is None else int(self._child.pid)

    @property
    def exitcode(self) -> int | None:
        """The child's exit status (None before it started and while it runs)."""
        return None if self._child is None else self._child.exitcode

    def stop(self) -> None:
        """End the child (and wait for it): the service stops, or the child outlived its last word."""
        self._stopped.set()
        child = self._child
        if child is not None and child.is_alive():
            child.terminate()
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
                child.join()


def log_progress(progress: Progress, every: float, stop: threading.Event) -> None:
    """Log progress.line() every `every` seconds until `stop` is set (a daemon thread's body)."""
    while not stop.wait(every):
        logger.info("%s", progress.line())


if __name__ == "__main__":  # `python -m fragsearch.service.prepare`, as the docs write it: the command's alias
    import sys

    from fragsearch.commands.prepare import main

    sys.exit(main())
