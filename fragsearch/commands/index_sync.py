"""Keep an image index in step with a folder of photos: one command, safe to re-run and to interrupt.

    fragsearch index ~/Pictures                          # or: python -m fragsearch.index.sync ~/Pictures
    fragsearch index ~/Pictures --image-index artifacts/index/my-photos --workers 2

The folder is walked recursively, leaving out hidden files and folders, the folders NAS systems and
file managers keep beside photos (`@eaDir`, `#recycle`, `$RECYCLE.BIN`, ...) and what the gitignore-style
patterns of `--exclude` and of the folder's `.fragsearchignore` match. Against the manifest kept in
the index folder (`sync-manifest.json`: per file, relative to the folder, its size, modification
time, content hash and image id), each run

- adds new files,
- re-extracts changed ones (size or modification time differ and the content hash too; a file
  only touched keeps its entry),
- follows renames and moves (a new path whose content is that of a vanished one: the features
  come back from the content-keyed feature cache, nothing is extracted again),
- removes images whose file is gone,
- reports files it cannot read (listed, not fatal) and formats it does not decode (camera RAW: listed
  as unsupported); HEIC/HEIF and AVIF photos are indexed like JPEGs (model.imageio).

Paths are stored relative to the folder, so the index still finds the photos when the folder is
mounted elsewhere. Work is saved every `--save-every` images, or, once the index is larger, every
quarter of its size up to `fragsearch.index.shards.COMMIT_IMAGES` (`commit_interval`: each save rewrites the
candidate index and the manifest, so a fixed interval would make a large first run quadratic): an
interrupted run keeps what it committed, and the next run adopts images the index holds but the
manifest does not know yet.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.index.sync import SAVE_EVERY
from fragsearch.model.bundle import Bundle
from fragsearch.service.collection import sync_collection

logger = logging.getLogger(__name__)

# the settings `fragsearch index` reads (its flags); every other one comes from the same places too
INDEX_SETTINGS = ("collection", "model_path", "variant", "artifacts", "cache", "image_index", "workers", "exclude",
                  "index_kind", "index_backend", "milvus_uri", "device")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, nargs="?", default=None,
                    help="the folder of photos (searched recursively); default: the `collection` setting")
    ap.add_argument("--save-every", type=int, default=SAVE_EVERY,
                    help="images added between two commits (at least; a quarter of a larger index's size)")
    add_setting_flags(ap, INDEX_SETTINGS)
    args = ap.parse_args(argv)
    fixed = {} if args.folder is None else {"collection": args.folder}
    settings = settings_of(ap, args, **fixed)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.collection is None:
        ap.error("name the folder of photos (or set `collection` in fragsearch.toml, FRAGSEARCH_COLLECTION)")
    if not settings.collection.is_dir():
        sys.stderr.write(f"{ap.prog}: not a folder: {settings.collection}\n")
        return 2
    with os.scandir(settings.collection):  # PermissionError for a folder it cannot list: not an empty folder
        pass
    if not settings.model_path.exists():
        sys.stderr.write(f"{ap.prog}: no model at {settings.model_path}: leave model_path and variant unset to use "
                         "the released model (model/released/), or train one with fragsearch train\n")
        return 2
    report = sync_collection(settings, Bundle.load(settings.model_path, device=settings.device, places=settings.places),
                             save_every=args.save_every)
    for rel, reason in report.unreadable:
        logger.warning("unreadable: %s (%s)", rel, reason)
    for rel in report.unsupported:
        logger.warning("unsupported format (Pillow cannot open it): %s", rel)
    logger.info("%s -> %s: %s", settings.collection, settings.image_index, report.summary())
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
