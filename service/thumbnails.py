"""Thumbnails of indexed images: a few fixed sizes, made once and kept in a cache folder.

A request's size is rounded up to the next of `SIZES` (the largest when it asks for more), so the
cache holds at most len(SIZES) files per image. A thumbnail's file name is a hash of the source's
path, size and modification time plus the thumbnail size: an image replaced on disk gets a new
thumbnail, and thumbnails of deleted images are never served again (their ids are never reused).
Files are written atomically; two requests making the same thumbnail both write whole files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

from PIL import Image

from fragsearch.model.atomic import cached_file
from fragsearch.model.imageio import read_image

SIZES = (64, 128, 256, 512)
QUALITY = 85


def snap(size: int) -> int:
    """The thumbnail size served for a requested one: the smallest of SIZES not below it."""
    return next((s for s in SIZES if s >= size), SIZES[-1])


# formats most browsers cannot show: the page and GET /images/{id} get a JPEG rendition of them
NOT_FOR_BROWSERS = frozenset({".heic", ".heif", ".avif", ".tif", ".tiff"})


def browser_readable(source: Path) -> bool:
    return source.suffix.lower() not in NOT_FOR_BROWSERS


def thumbnail(source: Path, size: int | None, cache_dir: Path, max_pixels: int) -> Path:
    """The cached JPEG of `source` whose longer side is `size` at most (never enlarged; None: the full
    size, a browser-readable rendition of a HEIC, AVIF or TIFF original); made when missing. Raises
    model.imageio.ImageReadError when the source cannot be decoded."""
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{size}".encode()).hexdigest()[:32]
    out = cache_dir / f"{key}.jpg"

    def make() -> Image.Image | None:
        img = read_image(source, max_pixels=max_pixels, side=size or 0).image  # a JPEG at a reduced size
        if size is not None:
            img.thumbnail((size, size), Image.Resampling.LANCZOS)
        return img

    def write(img: Image.Image | None, fh: BinaryIO) -> None:
        assert img is not None
        img.save(fh, "JPEG", quality=QUALITY)

    cached_file(out, make, write, lambda _: None)
    return out
