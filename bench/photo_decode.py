"""What a photo user meets when indexing: decoding and extraction per photo at camera sizes, with and
without decoding a JPEG at reduced size (Pillow's `draft()`, the decoder's DCT scaling), on the CPU.

    python -m bench.photo_decode --images 12 --out docs/results/photo-decode.csv

The photos are made for the run in a temporary folder (removed after): the first --images dev pictures
scaled up to 12, 24 and 48 megapixels (Lanczos) and saved as JPEG (quality 90) and, where pillow-heif is
installed, as HEIC (quality 90, --heic-megapixels; `draft()` does not apply to it). For each photo, in one
process with the extraction's threads: the seconds to decode it fully (EXIF orientation applied) and to extract its
fragments with the released model's extractor, and the same with `draft("RGB", (--side, --side))` (the
decoded photo's sides at least --side, a power-of-two reduction), the boxes scaled back to the photo's
pixels. What reduced decoding changes is shown on the features: the cosine between the whole-photo
fragment of the two decodes, and the share of the full decode's region boxes that the reduced decode
finds again (IoU >= 0.7, boxes in the photo's pixels). Upscaled pictures are smoother than a camera's, so
the agreement here is an upper bound of what real photos give. Rows carry the machine and the command.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from bench import machine, parse_run, write_rows
from model.bundle import Bundle
from model.data import load_split
from model.image import ImageFragments, RegionExtractor
from model.imageio import load_image
from model.release import RELEASED_MODEL
from model.settings import default_data_dir

logger = logging.getLogger("bench.photo_decode")
SIZES_MP = (12, 24, 48)


def make_photo(src: Path, megapixels: int, fmt: str) -> bytes:
    """A dev picture scaled up to about `megapixels` (its aspect kept), encoded as `fmt`."""
    img = Image.open(src).convert("RGB")
    scale = (megapixels * 1e6 / (img.width * img.height)) ** 0.5
    big = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    big.save(buf, format=fmt, quality=90)
    return buf.getvalue()


def decode_reduced(data: bytes, side: int) -> tuple[Image.Image, tuple[int, int]]:
    """The photo decoded at reduced size (JPEG: `draft`), orientation applied, and its full size."""
    img = Image.open(io.BytesIO(data))
    full = img.size
    img.draft("RGB", (side, side))
    img.load()
    out = ImageOps.exif_transpose(img) or img
    if out.size != img.size and out.size[0] == img.size[1]:  # rotated by the EXIF orientation
        full = (full[1], full[0])
    return out.convert("RGB"), full


def scaled(frag: ImageFragments, size: tuple[int, int]) -> ImageFragments:
    """Fragments of a reduced decode with their boxes in the photo's own pixels."""
    fx, fy = size[0] / frag.width, size[1] / frag.height
    return ImageFragments(frag.boxes * np.asarray([fx, fy, fx, fy], np.float32), frag.features, size[0], size[1])


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of boxes a (N, 4) and b (M, 4)."""
    x0 = np.maximum(a[:, None, 0], b[None, :, 0])
    y0 = np.maximum(a[:, None, 1], b[None, :, 1])
    x1 = np.minimum(a[:, None, 2], b[None, :, 2])
    y1 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area = lambda z: (z[:, 2] - z[:, 0]) * (z[:, 3] - z[:, 1])  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


def measure(extractor: RegionExtractor, data: bytes, side: int, reduce: bool) -> tuple[float, float, ImageFragments]:
    """(decode seconds, extraction seconds, fragments in the photo's pixels)."""
    t0 = time.perf_counter()
    if reduce:
        img, full = decode_reduced(data, side)
    else:
        img = load_image(data, max_pixels=10**9)
        full = img.size
    t1 = time.perf_counter()
    frag = extractor.extract(img)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, scaled(frag, full) if reduce else frag


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=12, help="dev pictures made into photos of each size")
    ap.add_argument("--heic-megapixels", type=int, nargs="*", default=[12],
                    help="the HEIC sizes made (encoding a 48 MP HEIC takes minutes)")
    ap.add_argument("--side", type=int, default=1024, help="the reduced decode's smallest side (at least)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--out", type=Path, default=Path("docs/results/photo-decode.csv"), help="the rows written")
    args, command = parse_run(ap, argv, "bench.photo_decode")
    bundle = Bundle.load(RELEASED_MODEL)
    extractor = RegionExtractor(bundle.image_cfg)
    pictures = [args.data / "images" / name for name in load_split(args.data, "dev").images[: args.images]]
    formats = ["JPEG"]
    try:
        import pillow_heif

        pillow_heif.register_heif_opener()
        formats.append("HEIF")
    except ImportError:
        logger.warning("pillow-heif is not installed: no HEIC rows")
    extractor.extract(Image.open(pictures[0]).convert("RGB"))  # sessions made before the clock runs
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            for mp in (SIZES_MP if fmt == "JPEG" else args.heic_megapixels):
                photos = []
                for k, src in enumerate(pictures):
                    path = Path(tmp) / f"{k}-{mp}.{fmt.lower()}"
                    path.write_bytes(make_photo(src, mp, fmt))
                    photos.append(path)
                ways = [False, True] if fmt == "JPEG" else [False]
                dec: dict[bool, list[float]] = {w: [] for w in ways}
                ext: dict[bool, list[float]] = {w: [] for w in ways}
                cos, found = [], []
                for path in photos:  # each photo decoded both ways in turn: a busy machine slows both alike
                    data = path.read_bytes()
                    frags = {}
                    for reduce in ways:
                        d, e, frags[reduce] = measure(extractor, data, args.side, reduce)
                        dec[reduce].append(d)
                        ext[reduce].append(e)
                    if True in frags:
                        ref, frag = frags[False], frags[True]
                        a, b = ref.features[0], frag.features[0]
                        cos.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
                        found.append(float((iou(ref.boxes[1:], frag.boxes[1:]).max(axis=1) >= 0.7).mean()))
                for reduce in ways:
                    per = statistics.median(d + e for d, e in zip(dec[reduce], ext[reduce], strict=True))
                    row = {"format": fmt, "megapixels": mp, "decode": f"draft >= {args.side} px" if reduce else "full",
                           "photos": len(photos), "decode_s": round(statistics.median(dec[reduce]), 4),
                           "extract_s": round(statistics.median(ext[reduce]), 4), "photos_per_s": round(1 / per, 2),
                           "whole_photo_cosine_min": round(min(cos), 4) if reduce else "",
                           "regions_found_again": round(statistics.mean(found), 3) if reduce else "",
                           "machine": machine(), "command": command}
                    rows.append(row)
                    logger.info("%s", {k: v for k, v in row.items() if k not in ("machine", "command")})
    write_rows(args.out, list(rows[0]), rows)
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
