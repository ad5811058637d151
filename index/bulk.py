"""Bulk image extraction into fragment shards (``index/shards.py``) on worker processes or Ray Data, resumable;
the command is `python -m fragsearch.index.bulk` (fragsearch/commands/index_bulk.py, which says more).

Two engines, one result: ``local``, the feature cache's ExtractionPool (``model/cache.py``); ``ray``, the
selective-search proposals as a CPU stage and the backbone half of the same RegionExtractor
(``extract_proposed``) on an actor pool. Images already in the shards are skipped, images already in the
feature cache copied from it; shards are written atomically as they fill."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import fragsearch
from fragsearch.index.shards import (
    DEFAULT_SHARD_SIZE,
    ShardWriter,
    done_paths,
    shard_settings,
    shard_summary,
)
from fragsearch.model.cache import FeatureCache
from fragsearch.model.config import ImageConfig
from fragsearch.model.detector import Detector
from fragsearch.model.features import PhotoReader
from fragsearch.model.image import ImageFragments, RegionExtractor, extractor_files, image_proposals
from fragsearch.model.imageio import ImageReadError
from fragsearch.model.onnx import set_threads
from fragsearch.model.places import DEFAULT_PLACES, Places
from fragsearch.model.proposals import proposal_columns

logger = logging.getLogger(__name__)

ENGINES = ("local", "ray")
DEFAULT_BATCH = 8  # images per task / per actor call
# the folder that holds the fragsearch package (a checkout, or site-packages): on the Ray workers' path
REPO_ROOT = Path(fragsearch.__file__).resolve().parent.parent
PROPOSAL_TASK_MEMORY = 640 * 2**20  # bytes reserved by a proposal task: its worker (torch, OpenCV) peaked at ~500 MB
RAY_ENV = ("FRAGSEARCH_ARTIFACTS", "FRAGSEARCH_DATA")  # settings the Ray workers must share with the driver


@dataclass
class BulkReport:
    """What one bulk run did: images extracted by the engine, copied from the feature cache, found in
    the shards already, skipped (unreadable), and the engine's wall-clock seconds."""

    extracted: int = 0
    from_cache: int = 0
    present: int = 0
    failed: int = 0
    seconds: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.extracted / self.seconds if self.seconds > 0 else 0.0


# -- the Ray stages (module level: Ray pickles them by reference) -------------------------------------


def propose_stage(batch: dict[str, np.ndarray], cfg: ImageConfig) -> dict[str, np.ndarray]:
    """CPU stage: image files → their bytes, content keys and proposals (flattened float32 bytes).

    An unreadable file gets its reason in ``error`` and passes through, so the driver records it."""
    set_threads(1)
    # the COCO detector, when the regions come from it: loaded once per batch (checked by hash), not per image
    detector = Detector() if cfg.proposals != "selective_search" and not cfg.full_frame_only else None
    keys, datas, props, errors = [], [], [], []
    reader = PhotoReader.of(cfg)
    for p in batch["path"]:
        path = str(p)
        data, key, boxes, error = b"", "", np.zeros((0, proposal_columns(cfg)), np.float32), ""
        try:
            data = Path(path).read_bytes()
            key = reader.key(data)
            boxes = image_proposals(reader.read(data, name=path).image, cfg, detector)
        except OSError as e:
            error = f"{path}: cannot open ({e.strerror or e})"
        except ImageReadError as e:
            error = str(e)
        keys.append(key)
        datas.append(data)
        props.append(np.ascontiguousarray(boxes, dtype=np.float32).tobytes())
        errors.append(error)
    return {"path": np.asarray([str(p) for p in batch["path"]], dtype=object), "key": np.asarray(keys, dtype=object),
            "data": np.asarray(datas, dtype=object), "proposals": np.asarray(props, dtype=object),
            "error": np.asarray(errors, dtype=object)}


class BackboneStage:
    """Actor stage: images + proposals → fragments, with the one RegionExtractor (its backbone half)."""

    def __init__(self, cfg: ImageConfig, device: str, runtime: str, places: Places = DEFAULT_PLACES) -> None:
        set_threads(1)
        self.cfg = cfg
        self.extractor = RegionExtractor(cfg, device, runtime, places)
        self.reader = PhotoReader.of(cfg)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n, n_frag = len(batch["path"]), self.cfg.n_fragments
        errors = [str(e) for e in batch["error"]]
        good: list[int] = []
        images, proposals = [], []
        for k in range(n):
            if errors[k]:
                continue
            try:
                images.append(self.reader.read(bytes(batch["data"][k]), name=str(batch["path"][k])))
            except ImageReadError as e:
                errors[k] = str(e)
                continue
            flat = np.frombuffer(bytes(batch["proposals"][k]), dtype=np.float32)
            proposals.append(flat.reshape(-1, proposal_columns(self.cfg)))
            good.append(k)
        frags: dict[int, ImageFragments] = {}
        try:
            frags = dict(zip(good, self.extractor.extract_proposed(images, proposals), strict=True))
        except Exception:  # isolate the image that breaks a batch
            for k, img, props in zip(good, images, proposals, strict=True):
                try:
                    frags[k] = self.extractor.extract_proposed([img], [props])[0]
                except Exception as e:
                    errors[k] = f"feature extraction failed: {type(e).__name__}: {e}"
        boxes = np.zeros((n, n_frag, 4), np.float32)
        features = np.zeros((n, n_frag, frags[good[0]].features.shape[1] if frags else 1), np.float32)
        sizes = np.zeros((n, 2), np.int64)
        for k, f in frags.items():
            boxes[k], features[k], sizes[k] = f.boxes, f.features, (f.width, f.height)
        return {"path": batch["path"], "key": batch["key"], "sizes": sizes, "boxes": boxes, "features": features,
                "error": np.asarray(errors, dtype=object)}


# -- engines ------------------------------------------------------------------------------------------

Sink = Callable[[str, str, ImageFragments | None, str], None]  # path, key, fragments or None, error


def ray_runtime_env() -> dict[str, Any]:
    """What the Ray workers need to import this code and find the graphs: the checkout on their
    PYTHONPATH and the driver's FRAGSEARCH_* settings."""
    env = {k: os.environ[k] for k in RAY_ENV if k in os.environ}
    path = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
    return {"env_vars": env}


@contextlib.contextmanager
def ray_session(address: str | None, workers: int) -> Iterator[None]:
    """Ray for one bulk run: joins the cluster at ``address``, else starts one on this machine with
    ``workers + 1`` logical CPUs (the actors never hold every CPU); shut down afterwards."""
    import ray

    if ray.is_initialized():
        yield
        return
    kwargs: dict[str, Any] = {"runtime_env": ray_runtime_env(), "include_dashboard": False,
                              "log_to_driver": False, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=workers + 1, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()


def extract_ray(paths: Sequence[str], cfg: ImageConfig, sink: Sink, workers: int = 1, batch: int = DEFAULT_BATCH,
                runtime: str = "auto", progress: bool = True, places: Places = DEFAULT_PLACES) -> None:
    """Run the two Ray Data stages over ``paths`` on the Ray Ray is connected to; every image ends in
    ``sink`` (fragments, or None and the reason it was skipped). ``places``: where the actors' files are."""
    import ray
    import ray.data

    gpus = ray.cluster_resources().get("GPU", 0.0)
    device = "cuda" if gpus >= 1 else "cpu"
    extractor_files(cfg, places)  # found or made once here, not by every actor at once
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the driver's tqdm bar below reports progress
    blocks = max(1, -(-len(paths) // batch))
    ds: ray.data.Dataset = ray.data.from_items([{"path": p} for p in paths], override_num_blocks=blocks)
    # the proposal tasks reserve memory and the actors do not: remote arguments that differ keep Ray Data
    # from fusing the proposals into the actors, so they stay a CPU stage of their own
    ds = ds.map_batches(functools.partial(propose_stage, cfg=cfg), batch_size=batch, batch_format="numpy", num_cpus=1,
                        memory=PROPOSAL_TASK_MEMORY)
    ds = ds.map_batches(BackboneStage, fn_constructor_kwargs={"cfg": cfg, "device": device, "runtime": runtime,
                                                                "places": places},
                        batch_size=batch, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=workers),
                        num_cpus=0 if device == "cuda" else 1, num_gpus=1 if device == "cuda" else 0)
    logger.info("extracting %d images on Ray: proposals on CPU tasks, the backbone on %d %s actor(s)", len(paths),
                workers, device.upper())
    with tqdm(total=len(paths), desc="extracting (ray)", unit="img", disable=not progress, smoothing=0.1) as bar:
        for out in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for k in range(len(out["path"])):
                error = str(out["error"][k])
                frags = None if error else ImageFragments(out["boxes"][k], out["features"][k],
                                                          int(out["sizes"][k][0]), int(out["sizes"][k][1]))
                sink(str(out["path"][k]), str(out["key"][k]), frags, error)
            bar.update(len(out["path"]))


def extract_local(paths: Sequence[str], cache: FeatureCache, sink: Sink, workers: int = 1,
                  batch: int = DEFAULT_BATCH, progress: bool = True) -> None:
    """The feature cache's ExtractionPool over ``paths`` (entries stored in ``cache``), then each
    image to ``sink``."""
    report = cache.ensure([Path(p) for p in paths], workers=workers, batch=batch, progress=progress)
    failed = dict(report.failed)
    for p in paths:
        name = Path(p).name
        if name in failed:
            sink(p, "", None, failed[name])
            continue
        try:
            sink(p, cache.key(p), cache.load([p])[0], "")
        except (KeyError, OSError) as e:  # the file changed or vanished after extraction
            sink(p, "", None, f"unreadable: {e}")


# -- one bulk run -------------------------------------------------------------------------------------


def bulk_extract(paths: Sequence[Path | str], shards: Path, cfg: ImageConfig, engine: str = "local",
                 workers: int = 1, cache: FeatureCache | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
                 batch: int = DEFAULT_BATCH, runtime: str = "auto", progress: bool = True,
                 places: Places = DEFAULT_PLACES) -> BulkReport:
    """Extract the images of ``paths`` that the shards at ``shards`` do not hold yet, into new shards.

    With ``cache``, images already in that feature cache are copied from it. The ``ray`` engine runs
    on the Ray this process is connected to (`ray_session`). ``places``: where the extractors' files are
    (model/places.py; a given cache's own places win for what it extracts)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    cfg = shard_settings(cfg)
    report = BulkReport()
    with ShardWriter(shards, cfg, shard_size) as writer:
        done = done_paths(shards)
        wanted: dict[str, None] = {}
        for p in paths:
            wanted.setdefault(str(Path(p).resolve()), None)
        todo = [p for p in wanted if p not in done]
        report.present = len(wanted) - len(todo)
        if cache is not None and engine != "local":  # the local engine reuses the cache as it extracts
            left = []
            for p in todo:
                if cache.has(p):
                    writer.add_cached(cache.key(p), Path(p).name, p, cache.path(p))
                    report.from_cache += 1
                else:
                    left.append(p)
            todo = left
        logger.info("%d images to extract into %s (%d in its shards already, %d copied from the feature cache)",
                    len(todo), shards, report.present, report.from_cache)

        def sink(path: str, key: str, frags: ImageFragments | None, error: str) -> None:
            if frags is None:
                writer.fail(Path(path).name, error)
                report.failed += 1
            else:
                writer.add(key, Path(path).name, path, frags)
                report.extracted += 1

        start = time.perf_counter()
        if todo and engine == "ray":
            extract_ray(todo, cfg, sink, workers, batch, runtime, progress, places)
        elif todo:
            with contextlib.ExitStack() as stack:
                local = cache
                if local is None:
                    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fragsearch-bulk-")))
                    local = FeatureCache(tmp, cfg, runtime=runtime, places=places)
                extract_local(todo, local, sink, workers, batch, progress)
        report.seconds = time.perf_counter() - start
    logger.info("%s: %d extracted (%.2f images/s), %d from the cache, %d present, %d failed; %s", shards,
                report.extracted, report.images_per_s, report.from_cache, report.present, report.failed,
                shard_summary(shards))
    return report


if __name__ == "__main__":  # `python -m fragsearch.index.bulk`, as the docs write it: the command's alias
    from fragsearch.commands.index_bulk import main

    main()
