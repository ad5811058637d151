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
import shutil
from collections.abc import Sequence
from pathlib import Path

from fragsearch.index.catalogue import is_index
from fragsearch.index.files import list_images
from fragsearch.index.flags import add_index_flags, index_settings_of
from fragsearch.index.images import ImageIndex
from fragsearch.index.sentences import DEFAULT_SETTINGS as SENTENCE_DEFAULTS
from fragsearch.index.sentences import SentenceIndex
from fragsearch.index.types import BACKENDS, BackendOptions, IndexSettings
from fragsearch.model.bundle import Bundle
from fragsearch.model.cache import FeatureCache
from fragsearch.model.data import read_captions, read_split_list
from fragsearch.model.dataset import feature_cache
from fragsearch.model.fragments import parse_cached
from fragsearch.settings import (
    default_artifacts_dir,
    default_cache_dir,
    default_model_path,
    default_places,
)

logger = logging.getLogger(__name__)

SAVE_EVERY = 2000  # images added between two saves of a long build


def read_sentences(path: Path, split: Path | None = None) -> list[str]:
    """Captions to index: a Flickr8K-style file (`<image>#<n>\\t<caption>`, restricted to the images of
    `split` when given, in its order) or a plain file with one sentence per line."""
    path = Path(path)
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines or "\t" not in lines[0]:
        if split is not None:
            raise ValueError(f"--split needs a caption file of '<image>#<n>\\t<caption>' lines; {path} is plain text")
        return [ln.strip() for ln in lines]
    by_image = read_captions(path)
    names = read_split_list(split) if split is not None else list(by_image)
    missing = sum(1 for n in names if n not in by_image)
    if missing:
        logger.warning("%d images of %s have no caption in %s", missing, split, path)
    return [c for n in names for c in by_image.get(n, [])]


def _fresh_target(out: Path, rebuild: bool, resumable: bool = True) -> Path:
    """Where to build: `out` itself (a resumable build), or a sibling that replaces it once complete
    (a rebuild, or a build that cannot resume: then an interrupted build never leaves a half-filled
    index where a finished one is expected)."""
    if resumable and (not rebuild or not out.exists()):
        return out
    tmp = out.with_name(out.name + ".building")
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def _swap_in(built: Path, out: Path) -> None:
    if built == out:
        return
    if not out.exists():
        built.rename(out)
        return
    old = out.with_name(out.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    out.rename(old)
    built.rename(out)
    shutil.rmtree(old)


def build_image_index(bundle: Bundle, paths: Sequence[Path], out: Path, settings: IndexSettings,
                      cache: FeatureCache | None = None, workers: int = 1, rebuild: bool = False,
                      save_every: int = SAVE_EVERY, collection_root: Path | None = None,
                      backend: BackendOptions | None = None) -> ImageIndex:
    """Index `paths` into the image index at `out` (created, extended, or rebuilt), saving as it goes.

    Paths under `collection_root` are stored relative to it (ImageIndex.create); `backend` is where a
    new index keeps its candidate vectors (an existing one keeps its own)."""
    out = Path(out)
    target = _fresh_target(out, rebuild)
    if is_index(target):
        index = ImageIndex.load(target, bundle, cache=cache, collection_root=collection_root, backend=backend)
        if index.settings.shape.kind != settings.shape.kind:
            logger.warning("%s is a %s index; keeping it (use --rebuild for %s)", out, index.settings.shape.kind,
                           settings.shape.kind)
    else:
        index = ImageIndex.create(target, bundle, settings, cache=cache, collection_root=collection_root,
                                  backend=backend)
    todo = [Path(p).resolve() for p in paths]
    present = index.photos.find(todo)
    todo = [p for p in todo if str(p) not in present]
    logger.info("%d images to add to %s (%d there already)", len(todo), out, len(present))
    skipped = 0
    if index.settings.shape.trainable and not index.candidates.trained:
        with index.bulk():  # one training on a sample of everything, then one insert
            skipped += len(index.photos.add(todo, workers=workers, skip_present=False).skipped)
        index.save()
    else:
        for start in range(0, len(todo), save_every):
            chunk = todo[start : start + save_every]
            skipped += len(index.photos.add(chunk, workers=workers, skip_present=False).skipped)
            index.save()
    index.close()
    _swap_in(target, out)
    logger.info("image index %s: %d images added, %d unreadable files skipped", out, len(todo) - skipped, skipped)
    return ImageIndex.load(out, bundle, cache=cache, collection_root=collection_root, backend=backend)


def write_sentence_index(bundle: Bundle, sentences: Sequence[str], out: Path, settings: IndexSettings,
                         parse_dir: Path | None = None, rebuild: bool = False,
                         vectors_dir: Path | None = None, backend: BackendOptions | None = None) -> bool:
    """Write the sentence index at `out` over `sentences`, unless one is there (and not `rebuild`): whether it was
    written. Nothing of it stays loaded in this process (a preparation hands it to the service's).

    With `parse_dir`, parses are cached there (shared with the trainer: same sentences, same file);
    with `vectors_dir` too, so are the frozen MiniLM vectors (the trainer's training captions are the
    default sentence collection: their vectors are not computed twice).
    """
    out = Path(out)
    if is_index(out) and not rebuild:
        logger.info("sentence index %s exists; --rebuild makes it again", out)
        return False
    target = _fresh_target(out, rebuild, resumable=False)
    index = SentenceIndex.create(target, bundle, settings, backend=backend)
    with index.bulk():
        if parse_dir is not None:
            parsed = parse_cached(bundle.text.parser, list(sentences), parse_dir)
            if vectors_dir is not None:
                bundle.text.warm(parsed, sentences, vectors_dir)
            index.add(sentences, parsed)
            bundle.text.forget()
        else:
            index.add(sentences)
    index.save()
    index.close()
    _swap_in(target, out)
    logger.info("sentence index %s: %d sentences", out, len(sentences))
    return True


def build_sentence_index(bundle: Bundle, sentences: Sequence[str], out: Path, settings: IndexSettings,
                         parse_dir: Path | None = None, rebuild: bool = False,
                         vectors_dir: Path | None = None, backend: BackendOptions | None = None) -> SentenceIndex:
    """The sentence index at `out` over `sentences`, loaded: written first (`write_sentence_index`) unless one is
    there and not `rebuild`."""
    write_sentence_index(bundle, sentences, out, settings, parse_dir, rebuild, vectors_dir, backend)
    return SentenceIndex.load(Path(out), bundle, backend=backend)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path(),
                    help="the checkpoint (model.pt); default: the served model (model/release.py: the released one "
                         "unless FRAGSEARCH_MODEL_PATH or FRAGSEARCH_VARIANT names another)")
    ap.add_argument("--images", type=Path, help="folder of images (searched recursively)")
    ap.add_argument("--image-list", type=Path, help="only the images named in this file (one name per line)")
    ap.add_argument("--out", type=Path, help="image index folder")
    ap.add_argument("--collection-root", type=Path, default=None,
                    help="store image paths relative to this folder (the service's FRAGSEARCH_DATA), so the "
                         "index moves with the collection (host / container); default: absolute paths")
    ap.add_argument("--captions", type=Path, help="sentences to index: Flickr8K captions.txt or one per line")
    ap.add_argument("--split", type=Path, help="only the captions of the images named in this list")
    ap.add_argument("--sentences-out", type=Path,
                    help="sentence index folder (default: beside --out, sentences-<split name>)")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(),
                    help="feature / parse cache shared with the trainer")
    ap.add_argument("--no-cache", action="store_true", help="extract features without the shared cache")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.images is None and args.captions is None:
        ap.error("give --images and/or --captions")
    if args.images is not None and args.out is None:
        ap.error("--images needs --out")
    if args.uri is not None and args.backend != "milvus":
        ap.error("--uri needs --backend milvus")
    backend = BackendOptions(args.backend, args.uri)
    bundle = Bundle.load(args.model, places=default_places(args.cache))
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
                 else feature_cache(args.cache, bundle.image_cfg, artifacts=bundle.places.artifacts))
        index = build_image_index(bundle, paths, args.out, settings, cache, args.workers, args.rebuild,
                                  args.save_every, collection_root=args.collection_root, backend=backend)
        logger.info("image index %s: %d images, %d fragments", args.out, len(index), index.n_fragments)
    if args.captions is not None:
        out = args.sentences_out
        if out is None:
            base = args.out.parent if args.out is not None else default_artifacts_dir() / "index"
            out = base / f"sentences-{args.split.stem if args.split else 'all'}"
        sentences = read_sentences(args.captions, args.split)
        parse_dir = None if args.no_cache else args.cache / "parses"
        sindex = build_sentence_index(bundle, sentences, out, sentence_settings, parse_dir, args.rebuild,
                                      None if args.no_cache else args.cache / "vectors", backend)
        logger.info("sentence index %s: %d sentences, %d fragments", out, len(sindex), sindex.n_fragments)


if __name__ == "__main__":
    main()
