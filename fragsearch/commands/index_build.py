"""Build (or extend) an image index from a folder of images, and a sentence index from captions.

    python -m fragsearch.index.build --model artifacts/models/full/model.pt --images ../shared/data/flickr8k/images \\
        --image-list ../shared/data/flickr8k/dev.txt --out artifacts/index/images-dev \\
        --captions ../shared/data/flickr8k/captions.txt --split ../shared/data/flickr8k/train.txt

`--backend milvus` keeps the candidate vectors in Milvus instead of an in-process FAISS file:
`--uri http://host:19530` for a Milvus server or cluster, `--uri path/file.db` (or no --uri: a
`milvus.db` folder inside each index folder) for milvus-lite.

Any folder of images works (searched recursively): a user's own photos as well as Flickr8K. An
existing image index at --out is extended with the images it does not hold yet; --rebuild builds
a new one beside it and swaps it in when complete. Region features go through the shared feature
cache (--cache), so images the trainer saw are not extracted twice.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fragsearch.commands.flags import add_index_flags, add_setting_flags, index_settings_of, settings_of
from fragsearch.index.build import SAVE_EVERY, build_image_index, build_sentence_index, read_sentences
from fragsearch.index.files import list_images
from fragsearch.index.sentences import DEFAULT_SETTINGS as SENTENCE_DEFAULTS
from fragsearch.index.types import BACKENDS, BackendOptions, IndexSettings
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import read_split_list
from fragsearch.model.dataset import feature_cache

logger = logging.getLogger(__name__)

def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="the checkpoint (model.pt); default: the served model, the model_path setting (the released "
                         "one unless FRAGSEARCH_MODEL_PATH or FRAGSEARCH_VARIANT names another)")
    ap.add_argument("--images", type=Path, help="folder of images (searched recursively)")
    ap.add_argument("--image-list", type=Path, help="only the images named in this file (one name per line)")
    ap.add_argument("--out", type=Path, help="image index folder")
    ap.add_argument("--collection-root", type=Path, default=None,
                    help="store image paths relative to this folder (the service's FRAGSEARCH_DATA), so the "
                         "index moves with the collection (host / container); default: absolute paths")
    ap.add_argument("--split", type=Path, help="only the captions of the images named in this list")
    ap.add_argument("--sentences-out", type=Path,
                    help="sentence index folder (default: beside --out, sentences-<split name>)")
    ap.add_argument("--no-cache", action="store_true", help="extract features without the shared cache")
    ap.add_argument("--rebuild", action="store_true",
                    help="build anew instead of extending what is at --out")
    ap.add_argument("--save-every", type=int, default=SAVE_EVERY,
                    help="images added between two commits of the index (an interrupted build resumes from the last)")
    add_index_flags(ap, IndexSettings())
    ap.add_argument("--backend", default="faiss", choices=BACKENDS,
                    help="where candidate vectors are searched: in-process FAISS, or Milvus")
    ap.add_argument("--uri", default=None,
                    help="Milvus: a server (http://host:19530) or a milvus-lite folder (file.db); default: "
                         "milvus.db inside each index folder")
    add_index_flags(ap, SENTENCE_DEFAULTS, ("k_prime", "rerank"), prefix="sentence-", what="sentence index: ")
    add_setting_flags(ap, ("cache", "workers", "captions"))  # captions: the sentences to index
    args = ap.parse_args(argv)
    run = settings_of(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    captions = run.captions
    if args.images is None and captions is None:
        ap.error("give --images and/or --captions")
    if args.images is not None and args.out is None:
        ap.error("--images needs --out")
    if args.uri is not None and args.backend != "milvus":
        ap.error("--uri needs --backend milvus")
    backend = BackendOptions(args.backend, args.uri)
    bundle = Bundle.load(args.model or run.model_path, places=run.places)
    try:
        settings = index_settings_of(args, IndexSettings())
        sentence_settings = index_settings_of(args, settings, prefix="sentence-")
    except ValueError as e:
        ap.error(str(e))
    if args.images is not None:
        paths = list_images(args.images)
        if args.image_list is not None:
            wanted = set(read_split_list(args.image_list))
            paths = [p for p in paths if p.name in wanted]
        if not paths:
            raise SystemExit(f"no images found in {args.images}")
        cache = (None if args.no_cache
                 else feature_cache(run.cache, bundle.image_cfg, artifacts=bundle.places.artifacts))
        index = build_image_index(bundle, paths, args.out, settings, cache, run.worker_count, args.rebuild,
                                  args.save_every, collection_root=args.collection_root, backend=backend)
        logger.info("image index %s: %d images, %d fragments", args.out, len(index), index.n_fragments)
    if captions is not None:
        out = args.sentences_out
        if out is None:
            base = args.out.parent if args.out is not None else run.artifacts / "index"
            out = base / f"sentences-{args.split.stem if args.split else 'all'}"
        sentences = read_sentences(captions, args.split)
        parse_dir = None if args.no_cache else run.cache / "parses"
        sindex = build_sentence_index(bundle, sentences, out, sentence_settings, parse_dir, args.rebuild,
                                      None if args.no_cache else run.cache / "vectors", backend)
        logger.info("sentence index %s: %d sentences, %d fragments", out, len(sindex), sindex.n_fragments)



if __name__ == "__main__":
    main()
