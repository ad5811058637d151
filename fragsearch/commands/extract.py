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

from fragsearch.commands.flags import add_region_flags, with_region_flags
from fragsearch.model.config import ImageConfig
from fragsearch.model.data import check_data_dir, load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.variants import VariantError, load_variant
from fragsearch.settings import default_cache_dir, default_data_dir

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_dir(),
                    help="the Flickr8K folder (default: FRAGSEARCH_DATA or ../shared/data/flickr8k)")
    ap.add_argument("--splits", nargs="*", default=["train", "dev"],
                    help="split names or lists; none = every file in images/")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(),
                    help="the feature, parse and vector cache (git-ignored); default: artifacts/cache")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
    ap.add_argument("--variant", default=None,
                    help="start from this variant's image settings (model/variants/<name>.toml; the released "
                         "model's recipe: full-2x256); default: ImageConfig's defaults")
    add_region_flags(ap, None)  # each overrides the variant's (or the defaults) only where given
    ap.add_argument("--limit", type=int, default=None, help="only the first N images of each split")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = check_data_dir(args.data)
    try:
        base = load_variant(args.variant).image if args.variant else ImageConfig()
    except VariantError as exc:
        ap.error(str(exc))
    cfg = with_region_flags(base, args)
    paths: list[Path] = []
    if args.splits:
        for split in args.splits:
            sp = load_split(root, split)
            sp = sp.subset(args.limit) if args.limit else sp
            paths += [sp.image_path(n) for n in sp.images]
    else:
        paths = sorted(p for p in (root / "images").iterdir() if p.is_file())
    cache = feature_cache(args.cache, cfg)
    report = cache.ensure(paths, workers=args.workers)
    logger.info("%s: %d extracted, %d reused, %d failed in %.1fs (%.2f images/s)", cache.dir, report.extracted,
                report.reused, len(report.failed), report.seconds, report.extracted / max(report.seconds, 1e-9))
