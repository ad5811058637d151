"""Search and annotate from a terminal, from the saved indexes, without a server.

    fragsearch search "a dog jumps over a log"                  # relevance and path of the best images
    fragsearch search "a dog on a beach" -f | xargs -d '\\n' open  # paths only, one a line, best first
    fragsearch search "a laptop on a desk" --min-relevance 0.5  # only likely matches; none: exit status 1
    fragsearch search "a laptop on a desk" --min-relevance 0.5  # only likely matches; none: exit status 1
    fragsearch search "two children" --json --k 20              # the service's answer: scores, alignments
    fragsearch annotate photo.jpg                              # the collection's sentences for a photo

The index searched is the served one (the `image_index` setting: the `collection` folder's index, made by
`fragsearch index DIR` or the service's first start, else the image split's); annotation ranks the sentence
index (`sentence_index`). Each line is a result's relevance (the probability a person would call it a match,
model.calibration) and its path, best first; with `--min-relevance 0.5` results less likely a match than not
are left out, and when none is left the reason goes to stderr and the exit status is 1, as grep's is when
nothing matches. Paths are absolute (the collection folder joined with the path the index keeps). The
answers are those of POST /search/images and POST /annotate: the same engine, scale and cut-off.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fragsearch.commands.flags import add_setting_flags, settings_of
from fragsearch.index.catalogue import is_index
from fragsearch.index.sentences import SentenceIndex
from fragsearch.index.types import ImageHit, IndexLoadError, SentenceHit
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import DEFAULT_CUTOFF
from fragsearch.model.features import PhotoReader
from fragsearch.model.imageio import ImageReadError
from fragsearch.service.engine import Engine
from fragsearch.service.errors import ApiError
from fragsearch.service.routes.convert import (
    check_min_relevance,
    image_result,
    missing_of,
    sentence_result,
    shown,
)
from fragsearch.settings import Settings

logger = logging.getLogger(__name__)

# what search and annotate read (their flags): which index, of which folder, with which model, where
READ_SETTINGS = ("collection", "image_index", "sentence_index", "model_path", "variant", "artifacts", "data",
                 "image_split", "sentence_split", "index_backend", "milvus_uri", "device", "threads")
BAD_INPUT = 2  # exit status: a query or photo path the command cannot use (a usage error)
NOTHING_FOUND = 1  # exit status: no result reaches the cut-off
# a missing index (IndexLoadError) and an unreadable photo (ImageReadError) are raised: the `fragsearch` command
# answers each with one line and its exit status (fragsearch/cli.py, KNOWN)


def _parser(prog: str | None, what: str, doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=10, help=f"number of {what} (default 10)")
    ap.add_argument("--min-relevance", type=float, default=None, metavar="R",
                    help=f"leave out {what} whose relevance is below R (0 to 1; {DEFAULT_CUTOFF}: as likely a "
                         "match as not, where the page starts); default: none, the k best")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the service's JSON answer (scores, alignments)")
    return ap


def _checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.k < 1:
        ap.error("--k must be at least 1")
    if args.min_relevance is not None and not 0.0 <= args.min_relevance <= 1.0:
        ap.error("--min-relevance must be between 0 and 1")


def _model(settings: Settings) -> Bundle:
    return Bundle.load(settings.model_path, device=settings.device, places=settings.places)


def _print_json(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer, indent=1, ensure_ascii=False) + "\n")


def _refused(message: str) -> int:
    sys.stderr.write(f"fragsearch: {message}\n")
    return BAD_INPUT


def search_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """`fragsearch search SENTENCE`: the images of the served index for a sentence."""
    ap = _parser(prog, "images", __doc__ or "")
    ap.add_argument("sentence", help="what to look for, in English")
    ap.add_argument("-f", "--paths", action="store_true", help="print only the paths, one a line (for pipes)")
    add_setting_flags(ap, READ_SETTINGS)
    args = ap.parse_args(argv)
    _checked(ap, args)
    if args.json and args.paths:
        ap.error("--json and --paths exclude each other")
    settings = settings_of(ap, args)
    if not is_index(settings.image_index):
        where = f"the collection {settings.collection}" if settings.mode == "collection" else "the image split"
        raise IndexLoadError(f"no image index at {settings.image_index} ({where}): make it with `fragsearch index "
                             "DIR` or `fragsearch serve`, or name the folder with --collection")
    t0 = time.perf_counter()
    engine = Engine.load(settings, with_sentences=False)
    try:
        try:
            check_min_relevance(args.min_relevance, engine.bundle.relevance)
            page = engine.search_images(args.sentence, args.k)
        except ApiError as e:
            return _refused(e.message)
        view = shown(engine.bundle, "images", page, args.min_relevance)
        hits, weaker, cut = view.hits, view.weaker, view.cut
    finally:
        engine.images.close()
    root = settings.collection_root
    if not hits:
        sys.stderr.write(f"{cut['reason'] or 'no image in the index'}\n")
    if args.json:
        def out(results: list[ImageHit]) -> list[dict[str, Any]]:
            return [{**image_result(h, view.of(h)).model_dump(mode="json"), "file": str(root / h.file)}
                    for h in results]

        _print_json({"sentence": args.sentence, "results": out(hits), "weaker": out(weaker), **cut,
                     "took_ms": round(1000 * (time.perf_counter() - t0), 1)})
    elif args.paths:
        for h in hits:
            sys.stdout.write(f"{root / h.file}\n")
    else:
        _write_lines([(h, str(root / h.file)) for h in hits], [(h, str(root / h.file)) for h in weaker], view.of,
                     args.min_relevance)
    return 0 if hits else NOTHING_FOUND


def _write_lines(kept: Sequence[tuple[ImageHit | SentenceHit, str]],
                 weaker: Sequence[tuple[ImageHit | SentenceHit, str]], relevance: Callable[[Any], float | None],
                 cutoff: float | None) -> None:
    """One line a result that reaches the cut-off on stdout, what a script reads: its relevance (`relevance`
    of the result, the page's `Shown.of`; None: the model has no scale), a tab, the path or the sentence. The
    results under the cut-off on stderr, for a person, after a line that says so, each with the things it
    misses."""
    def line(h: ImageHit | SentenceHit, what: str, lacking: bool = False) -> str:
        value = relevance(h)
        shown = "" if value is None else f"{value:.3f}\t"
        lacks = missing_of(h.found) if lacking else []
        return f"{shown}{what}" + (f"  (not found: {', '.join(lacks)})" if lacks else "") + "\n"

    for h, what in kept:
        sys.stdout.write(line(h, what))
    if weaker:
        sys.stderr.write(f"-- weaker matches (relevance below {cutoff:.2f}) --\n")
        for h, what in weaker:
            sys.stderr.write(line(h, what, lacking=True))


def annotate_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """`fragsearch annotate IMAGE`: the sentences of the sentence index for a photo."""
    ap = _parser(prog, "sentences", __doc__ or "")
    ap.add_argument("image", type=Path, help="a photo (JPEG, PNG, HEIC, ...)")
    add_setting_flags(ap, READ_SETTINGS)
    args = ap.parse_args(argv)
    _checked(ap, args)
    settings = settings_of(ap, args)
    try:  # the photo named first: a path that is not there is a usage error, whatever the index
        data = args.image.read_bytes()
    except (FileNotFoundError, NotADirectoryError) as e:
        return _refused(f"cannot read {args.image}: {e.strerror or e}")
    if not is_index(settings.sentence_index):
        raise IndexLoadError(f"no sentence index at {settings.sentence_index}: `fragsearch serve` builds it from "
                             "the data folder's captions (or the `captions` setting's file) on its first start")
    t0 = time.perf_counter()
    bundle = _model(settings)
    try:  # a large JPEG decoded at the model's reading side, as the service reads an upload
        image = PhotoReader.of(bundle.image_cfg, settings.max_pixels).read(data)
    except ImageReadError as e:
        raise type(e)(f"{args.image}: {e}") from e
    sentences = SentenceIndex.load(settings.sentence_index, bundle, backend=settings.backend)
    try:
        try:
            check_min_relevance(args.min_relevance, bundle.relevance)
        except ApiError as e:
            return _refused(e.message)
        page = sentences.annotate(image, args.k)
    finally:
        sentences.close()
    view = shown(bundle, "sentences", page, args.min_relevance)
    hits, weaker, cut = view.hits, view.weaker, view.cut
    if not hits:
        sys.stderr.write(f"{cut['reason'] or 'no sentence in the index'}\n")
    if args.json:
        _print_json({"image": str(args.image), "width": image.width, "height": image.height,
                     "results": [sentence_result(h, view.of(h)).model_dump(mode="json") for h in hits],
                     "weaker": [sentence_result(h, view.of(h)).model_dump(mode="json") for h in weaker], **cut,
                     "took_ms": round(1000 * (time.perf_counter() - t0), 1)})
    else:
        _write_lines([(h, h.text) for h in hits], [(h, h.text) for h in weaker], view.of, args.min_relevance)
    return 0 if hits else NOTHING_FOUND
