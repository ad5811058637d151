"""Near-duplicates: the same photo resized, re-encoded or cropped a little, found by the cosine of the
images' whole-frame fragment (row 0 of the stored fragments: the model's embedding of the whole-image
CNN feature). A pair is a near-duplicate at cosine >= THRESHOLD, measured by bench/duplicates_bench.py
on altered copies of Flickr8K dev images against distinct photos (docs/results/duplicates-dev.csv).

    python -m fragsearch.index.duplicates artifacts/index/collection-...    # the collection-wide report
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.index.duplicates import THRESHOLD, duplicate_groups
from fragsearch.index.images import ImageIndex
from fragsearch.model.bundle import Bundle

logger = logging.getLogger(__name__)


# the settings `fragsearch duplicates` reads (its flags): which index, of which folder, with which model
DUPLICATES_SETTINGS = ("model_path", "variant", "artifacts", "collection", "image_index", "image_split", "data")

def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("index", type=Path, nargs="?", default=None,
                    help="an image index folder; default: the served one (the `image_index` setting: the "
                         "`collection`'s index, e.g. the one fragsearch index made, else the image split's)")
    ap.add_argument("--threshold", type=float, default=THRESHOLD, help="cosine at or above which two are duplicates")
    ap.add_argument("--json", type=Path, default=None, help="also write the groups (paths) as JSON here")
    add_setting_flags(ap, DUPLICATES_SETTINGS)
    args = ap.parse_args(argv)
    settings = settings_of(ap, args, **({} if args.index is None else {"image_index": args.index}))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    images = ImageIndex.load(settings.image_index, Bundle.load(settings.model_path, places=settings.places),
                             collection_root=settings.collection_root)
    try:
        total = len(images)
        groups = duplicate_groups(images, args.threshold)
        named = [[images.get(i).path for i in g] for g in groups]  # type: ignore[union-attr]
    finally:
        images.close()
    out = "".join(f"group {n} ({len(paths)} images):\n" + "".join(f"  {p}\n" for p in paths)
                  for n, paths in enumerate(named, 1))
    sys.stdout.write(out)
    logger.info("%d groups of near-duplicates (%d images) among %d images at cosine >= %.3f", len(groups),
                sum(map(len, groups)), total, args.threshold)
    if args.json is not None:
        args.json.write_text(json.dumps({"threshold": args.threshold, "groups": named}, indent=1))
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
