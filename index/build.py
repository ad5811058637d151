"""Build (or extend) an image index from image files, and a sentence index from captions: what the command
`python -m fragsearch.index.build` (fragsearch/commands/index_build.py, which says more) and the service's
preparation run. An existing image index is extended with the images it does not hold yet, or built anew beside
it and swapped in when complete; a sentence index is written whole, then swapped in."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from fragsearch.index.catalogue import is_index
from fragsearch.index.images import ImageIndex
from fragsearch.index.sentences import SentenceIndex
from fragsearch.index.types import BackendOptions, IndexSettings
from fragsearch.model.bundle import Bundle
from fragsearch.model.cache import FeatureCache
from fragsearch.model.data import read_captions, read_split_list
from fragsearch.model.fragments import parse_cached

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


if __name__ == "__main__":  # `python -m fragsearch.index.build`, as the docs write it: the command's alias
    from fragsearch.commands.index_build import main

    main()
