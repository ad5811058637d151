"""What a photo user meets when indexing: decoding and extraction per photo at camera sizes, read at the
picture's own size and at the model's reading side (``ImageConfig.decode_side``: a JPEG decoded at a
reduced size with Pillow's `draft()`, then reduced to that side), the rate of indexing a folder of them,
and whether the reading side keeps the answers.

    python -m bench.photo_decode --images 6 --folder 300 --out docs/results/photo-decode.csv \
        --folder-out docs/results/photo-index.csv

The photos are made for the run in a temporary folder (removed after): dev pictures scaled up (Lanczos) to
the shapes cameras make (12 MP 4,032 x 3,024, 24 MP 6,000 x 4,000, 48 MP 8,000 x 6,000; every other one
portrait) and saved as JPEG (quality 90) and, where pillow-heif is installed, as HEIC (quality 90,
--heic-megapixels). Two settings of the released model's extractor, side by side:
``own size`` (decode_side 0: the full decode, proposals and crops read from it) and ``side N`` (the
default, N = the model's decode_side).

- Per photo (--images of each size, one process with the extraction's threads): the seconds to decode and to
  extract; the share of the photos indexed (an extraction that fails counts against it); what the reading
  side changes in the features: the cosine between the whole-photo fragments of the two settings, the
  share of the own-size regions found again (IoU >= 0.7, in the photo's pixels), and the cosine between
  the whole-photo fragment and the small original's (the dev picture itself).
- A folder (--folder dev pictures as 12 MP JPEGs, both orientations): extracted as `fragsearch index`
  extracts a folder (the feature cache's pool of --workers processes, one thread each), photos per second
  including the pool's start and the share indexed; then ranked as dev is (R-sum of search and annotation
  over those pictures and their captions) from the features of each setting and from the dev pictures
  themselves.

Upscaled pictures are smoother than a camera's, so agreement here is an upper bound of what real photos
give. Rows carry the machine, its CPU flags and the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench import machine, made_extractor, parse_run, write_rows
from fragsearch.model.bundle import Bundle
from fragsearch.model.cache import FeatureCache
from fragsearch.model.config import ImageConfig
from fragsearch.model.data import load_split
from fragsearch.model.dataset import load_split_data, select_images
from fragsearch.model.features import PhotoReader
from fragsearch.model.image import ImageFragments, RegionExtractor
from fragsearch.model.parsers import make_parser
from fragsearch.model.release import RELEASED_MODEL
from fragsearch.model.resources import cpu_info
from fragsearch.settings import default_cache_dir, default_data_dir
from fragsearch.training.evaluate import evaluate_scores

logger = logging.getLogger("bench.photo_decode")
SIZES_MP = (12, 24, 48)
CAMERA = {12: (4032, 3024), 24: (6000, 4000), 48: (8000, 6000)}  # megapixels -> a camera's landscape size
FOLDER_MP = 12
FLAGS = ("avx2", "avx512f", "avx512_vnni", "amx_tile")


def cpu_flags() -> str:
    """The instruction sets that matter to the extraction's graphs, as this CPU has them."""
    have = cpu_info().flags
    return " ".join(f for f in FLAGS if f in have) or "none of " + " ".join(FLAGS)


def make_photo(src: Path, megapixels: int, fmt: str, portrait: bool = False) -> bytes:
    """A dev picture scaled up to a camera's picture of `megapixels` (CAMERA; turned to portrait with
    `portrait`), encoded as `fmt`."""
    img = Image.open(src).convert("RGB")
    width, height = CAMERA[megapixels]
    big = img.resize((height, width) if portrait else (width, height), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    big.save(buf, format=fmt, quality=90)
    return buf.getvalue()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of boxes a (N, 4) and b (M, 4)."""
    x0 = np.maximum(a[:, None, 0], b[None, :, 0])
    y0 = np.maximum(a[:, None, 1], b[None, :, 1])
    x1 = np.minimum(a[:, None, 2], b[None, :, 2])
    y1 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area = lambda z: (z[:, 2] - z[:, 0]) * (z[:, 3] - z[:, 1])  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


def measure(extractor: RegionExtractor, data: bytes) -> tuple[float, float, ImageFragments]:
    """(decode seconds, extraction seconds, fragments in the photo's pixels) under the extractor's setting."""
    t0 = time.perf_counter()
    photo = PhotoReader.of(extractor.cfg, max_pixels=10**9).read(data)
    t1 = time.perf_counter()
    frag = extractor.extract(photo)
    return t1 - t0, time.perf_counter() - t1, frag


def setting_name(cfg: ImageConfig) -> str:
    return f"side {cfg.decode_side}" if cfg.decode_side else "own size"


def per_photo(settings: list[ImageConfig], pictures: list[Path], formats: list[str], heic_mp: list[int],
              tmp: Path, stamp: dict[str, str]) -> list[dict[str, Any]]:
    """The per-photo rows: each photo read under each setting in turn (a busy machine slows both alike)."""
    extractors = [made_extractor(cfg) for cfg in settings]
    for ex in extractors:  # sessions made before the clock runs
        ex.extract(Image.open(pictures[0]).convert("RGB"))
    originals = [extractors[-1].extract(Image.open(src).convert("RGB")).features[0] for src in pictures]
    rows: list[dict[str, Any]] = []
    for fmt in formats:
        for mp in (SIZES_MP if fmt == "JPEG" else heic_mp):
            dec: list[list[float]] = [[] for _ in settings]
            ext: list[list[float]] = [[] for _ in settings]
            cos, found, to_original = [], [], []
            indexed = [0 for _ in settings]
            for n, (src, original) in enumerate(zip(pictures, originals, strict=True)):
                data = make_photo(src, mp, fmt, portrait=n % 2 == 1)
                frags: list[ImageFragments | None] = []
                for k, ex in enumerate(extractors):
                    try:
                        d, e, f = measure(ex, data)
                    except Exception as err:  # a photo the reader or the extractor refuses: not indexed
                        logger.warning("%s %d MP (%s): not indexed: %s", fmt, mp, setting_name(ex.cfg), err)
                        frags.append(None)
                        continue
                    indexed[k] += 1
                    dec[k].append(d)
                    ext[k].append(e)
                    frags.append(f)
                ref, frag = frags[0], frags[-1]
                if frag is not None:
                    to_original.append(cosine(frag.features[0], original))
                if ref is not None and frag is not None:
                    cos.append(cosine(ref.features[0], frag.features[0]))
                    found.append(float((iou(ref.boxes[1:], frag.boxes[1:]).max(axis=1) >= 0.7).mean()))
            for k, cfg in enumerate(settings):
                per = statistics.median(d + e for d, e in zip(dec[k], ext[k], strict=True)) if dec[k] else 0.0
                last = k == len(settings) - 1
                row = {"format": fmt, "megapixels": mp, "read": setting_name(cfg), "photos": len(pictures),
                       "indexed_share": round(indexed[k] / len(pictures), 3),
                       "decode_s": round(statistics.median(dec[k]), 4) if dec[k] else "",
                       "extract_s": round(statistics.median(ext[k]), 4) if ext[k] else "",
                       "photos_per_s": round(1 / per, 2) if per else "",
                       "whole_photo_cosine_min": round(min(cos), 4) if last and cos else "",
                       "regions_found_again": round(statistics.mean(found), 3) if last and found else "",
                       "original_cosine_min": round(min(to_original), 4) if last and to_original else "",
                       **stamp}
                rows.append(row)
                logger.info("%s", {k: v for k, v in row.items() if k not in stamp})
    return rows


def folder(settings: list[ImageConfig], args: argparse.Namespace, bundle: Bundle, tmp: Path,
           stamp: dict[str, str]) -> list[dict[str, Any]]:
    """The folder rows: the dev pictures as 12 MP JPEGs, extracted as `fragsearch index` does, then ranked."""
    dev = load_split_data(args.data, "dev", bundle.image_cfg, args.cache, make_parser(bundle.text.cfg.parser),
                          workers=args.workers, limit=args.folder, device="cpu")
    dev = select_images(dev, np.arange(min(args.folder, len(dev.names))))
    photos_dir = tmp / "photos"
    photos_dir.mkdir()

    def make(n: int, name: str) -> Path:
        path = photos_dir / name
        path.write_bytes(make_photo(dev.split.image_path(name), FOLDER_MP, "JPEG", portrait=n % 2 == 1))
        return path

    with ThreadPoolExecutor(args.workers) as pool:
        paths = list(pool.map(make, range(len(dev.names)), dev.names))
    rows: list[dict[str, Any]] = []

    def ranked(read: str, feats: np.ndarray, seconds: float | None, rate: float | None, share: float | None) -> None:
        metrics, _ = evaluate_scores(bundle, dataclasses.replace(dev, feats=feats))
        row = {"read": read, "photos": len(dev.names), "workers": args.workers,
               "indexed_share": "" if share is None else round(share, 3),
               "index_s": "" if seconds is None else round(seconds, 1),
               "photos_per_s": "" if rate is None else round(rate, 2), "rsum": round(metrics["rsum"], 1),
               **{k: round(metrics[k], 1) for k in ("annot_r1", "annot_r5", "annot_r10",
                                                    "search_r1", "search_r5", "search_r10")}, **stamp}
        rows.append(row)
        logger.info("%s", {k: v for k, v in row.items() if k not in stamp})

    ranked(f"the dev pictures ({dev.split.image_path(dev.names[0]).suffix} as given)", dev.feats, None, None, None)
    for cfg in settings:
        cache = FeatureCache(tmp / f"cache-{cfg.decode_side}", cfg)
        report = cache.ensure(paths, workers=args.workers, progress=False)
        share = 1 - len(report.failed) / len(paths)
        if report.failed:  # no ranking over a part of the folder: the row says how much was indexed
            logger.warning("%s: %d photos not indexed (first: %s)", setting_name(cfg), len(report.failed),
                           report.failed[0])
            rows.append({"read": f"{FOLDER_MP} MP JPEG, {setting_name(cfg)}", "photos": len(dev.names),
                         "workers": args.workers, "indexed_share": round(share, 3), **stamp})
            continue
        feats = np.stack([f.features for f in cache.load(paths)]).astype(np.float32)
        ranked(f"{FOLDER_MP} MP JPEG, {setting_name(cfg)}", feats, report.seconds, report.images_per_s, share)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=6,
                    help="dev pictures made into photos of each size (per photo; 0: no per-photo rows)")
    ap.add_argument("--heic-megapixels", type=int, nargs="*", default=[12],
                    help="the HEIC sizes made (encoding a 48 MP HEIC takes minutes)")
    ap.add_argument("--folder", type=int, default=300, help="dev pictures in the indexed folder (0: no folder rows)")
    ap.add_argument("--sides", type=int, nargs="*", default=[],
                    help="more reading sides for the folder rows, beside own size and the model's")
    ap.add_argument("--workers", type=int, default=2, help="extraction processes for the folder (`fragsearch index`'s)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the dev pictures' feature cache")
    ap.add_argument("--out", type=Path, default=Path("docs/results/photo-decode.csv"), help="the per-photo rows")
    ap.add_argument("--folder-out", type=Path, default=Path("docs/results/photo-index.csv"), help="the folder rows")
    args, command = parse_run(ap, argv, "bench.photo_decode")
    bundle = Bundle.load(RELEASED_MODEL)
    settings = [dataclasses.replace(bundle.image_cfg, decode_side=0), bundle.image_cfg]
    if not bundle.image_cfg.decode_side:
        raise SystemExit("the released model reads every picture at its own size: nothing to compare")
    pictures = [args.data / "images" / name for name in load_split(args.data, "dev").images[: args.images]]
    formats = ["JPEG"]
    try:
        import pillow_heif  # noqa: F401  (model.imageio registers its opener)

        formats.append("HEIF")
    except ImportError:
        logger.warning("pillow-heif is not installed: no HEIC rows")
    stamp = {"machine": machine(), "cpu_flags": cpu_flags(), "command": command}
    with tempfile.TemporaryDirectory() as tmp:
        if args.images:
            rows = per_photo(settings, pictures, formats, args.heic_megapixels, Path(tmp), stamp)
            write_rows(args.out, list(rows[0]), rows)
            logger.info("wrote %s", args.out)
        if args.folder:
            more = [dataclasses.replace(bundle.image_cfg, decode_side=side) for side in args.sides
                    if side not in (0, bundle.image_cfg.decode_side)]
            frows = folder(settings + more, args, bundle, Path(tmp), stamp)
            write_rows(args.folder_out, list(frows[0]), frows)
            logger.info("wrote %s", args.folder_out)


if __name__ == "__main__":
    main()
