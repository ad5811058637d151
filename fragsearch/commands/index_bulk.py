"""Bulk image extraction into fragment shards (``index/shards.py``), then optionally into an index.

    python -m fragsearch.index.bulk --images DIR --shards artifacts/bulk/photos --engine ray --workers 2
    python -m fragsearch.index.bulk --images DIR --shards artifacts/bulk/photos --engine ray --address HEAD:6379
    python -m fragsearch.index.bulk --images DIR --shards artifacts/bulk/photos --engine local --workers 2
    python -m fragsearch.index.bulk --shards artifacts/bulk/photos --index artifacts/index/photos   (load only)

Two engines, one result:

* ``local`` — the feature cache's ExtractionPool (``model/cache.py``): worker processes on this machine,
  each running the whole RegionExtractor; the entries land in the feature cache, then in shards.
* ``ray`` — Ray Data: the selective-search proposals as a CPU stage (``map_batches`` tasks), the
  backbone half of the same RegionExtractor (``extract_proposed``) as a stage on an actor pool
  (``--workers`` actors; one GPU each where the cluster has GPUs, else one CPU each). Without
  ``--address`` Ray starts on this machine with one logical CPU more than the actors hold, so the
  proposal stage always has one (a dataset whose actors hold every CPU can hang); with ``--address``
  it joins that cluster, whose workers must see the image files and this code at the same paths.

Resumable: images already in the shards are skipped, images already in the feature cache (``--cache``)
are copied from it, and shards are written atomically as they fill (an interrupted run loses at most
one unfinished shard). Image settings are the model's (``--model``) unless region flags are given;
a shard folder holds one set of settings (its manifest).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

from fragsearch.commands.flags import (
    add_index_flags,
    add_region_flags,
    add_setting_flags,
    index_settings_of,
    settings_of,
    with_region_flags,
)
from fragsearch.index.bulk import DEFAULT_BATCH, ENGINES, bulk_extract, ray_session
from fragsearch.index.catalogue import is_index
from fragsearch.index.files import list_images
from fragsearch.index.images import ImageIndex
from fragsearch.index.shards import (
    DEFAULT_SHARD_SIZE,
    load_shards,
)
from fragsearch.index.types import IndexSettings
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import ImageConfig
from fragsearch.model.dataset import feature_cache

logger = logging.getLogger(__name__)

def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=Path, help="folder of images (searched recursively) to extract")
    ap.add_argument("--shards", type=Path, required=True, help="shard folder (written by extraction, read by --index)")
    ap.add_argument("--engine", choices=ENGINES, default="local",
                    help="local: worker processes on this machine; ray: Ray Data (this machine or --address)")
    ap.add_argument("--address", default=None, help="ray: the cluster to join (host:port of its head); "
                    "default: start Ray on this machine")
    ap.add_argument("--model", type=Path, default=None,
                    help="the model whose image settings are used (and that embeds the fragments with --index); "
                         "default: the model_path setting, the served model")
    add_region_flags(ap)
    ap.add_argument("--no-cache", action="store_true", help="neither read nor write the feature cache")
    ap.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="images per shard")
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="images per task / actor call")
    ap.add_argument("--index", type=Path, default=None,
                    help="then add the shards' images to this image index (created when missing)")
    # a new --index's settings (float16 store: half of float32's disk and reads, the choice for large collections)
    add_index_flags(ap, IndexSettings.of(store_dtype="float16"), what="a new --index: ")
    ap.add_argument("--remove-loaded", action="store_true",
                    help="with --index: delete each shard once a commit of the index holds its images")
    ap.add_argument("--collection-root", type=Path, default=None, help="as in index.build")
    add_setting_flags(ap, ("cache", "workers"))  # workers: local, extraction processes; ray, backbone actors
    args = ap.parse_args(argv)
    run = settings_of(ap, args)
    model = args.model or run.model_path
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.images is None and args.index is None:
        ap.error("give --images (extract) and/or --index (load)")
    try:
        new_settings = index_settings_of(args, IndexSettings())
    except ValueError as e:
        ap.error(str(e))
    places = run.places
    bundle = Bundle.load(model, places=places) if args.index is not None or model.is_file() else None
    if bundle is None and not any(getattr(args, k) is not None for k in ("region_features", "backbone_precision")):
        ap.error(f"{model} does not exist: give --model, or the region flags of the features wanted")
    cfg = with_region_flags(bundle.image_cfg if bundle is not None else ImageConfig(), args)
    if args.images is not None:
        paths = list_images(args.images)
        if not paths:
            raise SystemExit(f"no images found in {args.images}")
        cache = None if args.no_cache else feature_cache(run.cache, cfg, artifacts=places.artifacts)
        with ray_session(args.address, run.worker_count) if args.engine == "ray" else contextlib.nullcontext():
            bulk_extract(paths, args.shards, cfg, args.engine, run.worker_count, cache, args.shard_size, args.batch,
                         places=places)
    if args.index is not None:
        assert bundle is not None
        if is_index(args.index):
            index = ImageIndex.load(args.index, bundle, collection_root=args.collection_root)
        else:
            index = ImageIndex.create(args.index, bundle, new_settings,
                                      collection_root=args.collection_root)
        try:
            load_shards(index, args.shards, remove_loaded=args.remove_loaded)
            logger.info("image index %s: %d images, %d fragments", args.index, len(index), index.n_fragments)
        finally:
            index.close()



if __name__ == "__main__":
    main()
