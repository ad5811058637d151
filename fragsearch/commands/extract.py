"""Extract (or resume extracting) the image fragments of a data folder into the feature cache.

    python -m fragsearch.training.extract --data ../shared/data/flickr8k --splits train dev --workers 2
    python -m fragsearch.training.extract --variant full-2x256 --splits train dev     (the features that variant reads)

Without --variant the image settings are ImageConfig's own defaults; with it, that variant's (the
released model's recipe is `full-2x256`); the region flags override either.

Entries are written one image at a time, atomically: an interrupted run resumes where it stopped.
Unreadable files are skipped, counted and listed in the cache's failed.json.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fragsearch.commands.flags import add_region_flags, add_setting_flags, settings_of, with_region_flags
from fragsearch.model.config import ImageConfig
from fragsearch.model.data import check_data_dir, load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.variants import VariantError, load_variant
from fragsearch.training.graphs import make_graphs

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setting_flags(ap, ("data", "cache", "workers", "limit", "variant"))
    ap.add_argument("--splits", nargs="*", default=["train", "dev"],
                    help="split names or lists; none = every file in images/")
    add_region_flags(ap)  # each overrides the variant's (or the defaults) only where given
    args = ap.parse_args(argv)
    settings = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = check_data_dir(settings.data)
    try:
        base = load_variant(settings.variant).image if settings.variant else ImageConfig()
    except VariantError as exc:
        ap.error(str(exc))
    cfg = with_region_flags(base, args)
    paths: list[Path] = []
    if args.splits:
        for split in args.splits:
            sp = load_split(root, split)
            sp = sp.subset(settings.limit) if settings.limit else sp
            paths += [sp.image_path(n) for n in sp.images]
    else:
        paths = sorted(p for p in (root / "images").iterdir() if p.is_file())
    make_graphs(cfg, settings.places)  # the export step: what the extraction runs
    cache = feature_cache(settings.cache, cfg)
    report = cache.ensure(paths, workers=settings.worker_count)
    logger.info("%s: %d extracted, %d reused, %d failed in %.1fs (%.2f images/s)", cache.dir, report.extracted,
                report.reused, len(report.failed), report.seconds, report.extracted / max(report.seconds, 1e-9))
