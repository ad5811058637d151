"""The embedded default's preparation: train the model and build the two indexes if missing.

What exists is reused: a checkpoint is never retrained, a finished index built with this
checkpoint is loaded as it is, and an image index left half-built by an interrupted run is extended
with the images it lacks. An index built with another checkpoint (the model was retrained or
replaced) is set aside as `<name>.stale` and rebuilt; the stale copy is removed once the new one is
complete.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path

from index import IndexSettings
from index.base import built_fingerprint
from index.build import build_image_index, build_sentence_index
from index.fingerprint import model_fingerprint
from index.sentences import DEFAULT_SETTINGS as SENTENCE_DEFAULTS
from model.bundle import Bundle
from model.data import load_split
from model.dataset import feature_cache
from model.train import main as train_main
from service.settings import Settings

logger = logging.getLogger(__name__)

INDEX_DB = "index.sqlite"  # present once an index folder has been saved


def index_exists(root: Path) -> bool:
    return (root / INDEX_DB).is_file()


def _partial_marker(root: Path) -> Path:
    """Present beside an image index while its build is unfinished (it is saved every few thousand images)."""
    return root.parent / (root.name + ".partial")


def image_index_ready(root: Path) -> bool:
    return index_exists(root) and not _partial_marker(root).exists()


def ensure_model(settings: Settings) -> Path:
    """The checkpoint; trained with model.train (variant settings.variant) if absent."""
    path = settings.model_file
    if path.is_file():
        logger.info("model: reusing %s", path)
        return path
    logger.info("model: %s is missing; training the %r variant on %s (features are extracted and cached "
                "on first use; this takes a while on a CPU)", path, settings.variant, settings.data)
    t0 = time.perf_counter()
    train_main(["--data", str(settings.data), "--variant", settings.variant, "--out", str(path.parent),
                "--cache", str(settings.cache_dir), "--workers", str(settings.workers), "--device", settings.device])
    if not path.is_file():
        raise RuntimeError(f"training finished but wrote no checkpoint at {path}")
    logger.info("model: trained in %.0fs", time.perf_counter() - t0)
    return path


def ensure_image_index(settings: Settings, bundle: Bundle) -> Path:
    """The image index of the settings.image_split images (features from the shared cache)."""
    target = settings.image_index_dir
    if image_index_ready(target):
        logger.info("image index: reusing %s", target)
        return target
    split = load_split(settings.data, settings.image_split)
    logger.info("image index: indexing %d %s images into %s", len(split.images), settings.image_split, target)
    t0 = time.perf_counter()
    marker = _partial_marker(target)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    cache = feature_cache(settings.cache_dir, bundle.image_cfg, device=settings.device)
    index = build_image_index(bundle, [split.image_path(n) for n in split.images], target,
                              _index_settings(settings), cache=cache, workers=settings.workers)
    marker.unlink()
    logger.info("image index: %d images in %.0fs", len(index), time.perf_counter() - t0)
    index.close()
    return target


def ensure_sentence_index(settings: Settings, bundle: Bundle) -> Path:
    """The sentence collection: the captions of the settings.sentence_split images."""
    target = settings.sentence_index_dir
    if index_exists(target):
        logger.info("sentence index: reusing %s", target)
        return target
    split = load_split(settings.data, settings.sentence_split)
    sentences, _ = split.sentences()
    logger.info("sentence index: %d %s captions into %s", len(sentences), settings.sentence_split, target)
    t0 = time.perf_counter()
    index = build_sentence_index(bundle, sentences, target, _index_settings(settings, SENTENCE_DEFAULTS),
                                 parse_dir=settings.cache_dir / "parses", rebuild=target.exists(),
                                 vectors_dir=settings.cache_dir / "vectors")
    logger.info("sentence index: %d sentences in %.0fs", len(index), time.perf_counter() - t0)
    index.close()
    return target


def _index_settings(settings: Settings, base: IndexSettings | None = None) -> IndexSettings:
    """The index settings of a new index: `base` (default IndexSettings()) with the kind and device set."""
    return dataclasses.replace(base or IndexSettings(), kind=settings.index_kind,
                               use_gpu=settings.device.startswith("cuda"))


def _set_aside_if_stale(root: Path, fingerprint: str) -> Path | None:
    """Move an index built with another model to `<root>.stale`; returns where it went."""
    built = built_fingerprint(root)
    if built is None or built == fingerprint:
        return None
    stale = root.with_name(root.name + ".stale")
    logger.warning("%s was built with another model (fingerprint %s, this model %s): rebuilding it",
                   root, built, fingerprint)
    shutil.rmtree(stale, ignore_errors=True)
    root.rename(stale)
    _partial_marker(root).unlink(missing_ok=True)
    return stale


def prepare(settings: Settings) -> float:
    """Make sure the model and both indexes (built with that model) exist; returns the seconds spent."""
    t0 = time.perf_counter()
    ensure_model(settings)
    bundle = Bundle.load(settings.model_file, device=settings.device)
    fingerprint = model_fingerprint(bundle)
    stale = [p for p in (_set_aside_if_stale(settings.image_index_dir, fingerprint),
                         _set_aside_if_stale(settings.sentence_index_dir, fingerprint)) if p is not None]
    ensure_image_index(settings, bundle)
    ensure_sentence_index(settings, bundle)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    seconds = time.perf_counter() - t0
    logger.info("preparation took %.1fs", seconds)
    return seconds
