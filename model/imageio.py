"""Decoding image files and uploads into RGB PIL images, with clear errors for bad input.

Only Pillow (and pillow-heif, its HEIC/HEIF opener): the service's upload path imports this, not the
extractor (OpenCV, torch). Every image the project reads goes through `load_image`: uploads, the folder
sync and index builds (`IMAGE_SUFFIXES` are the file names they take), thumbnails, the feature cache.
Phones write HEIC (pillow-heif's libheif + libde265 decode it); AVIF is Pillow's own plugin.
"""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import pillow_heif
from PIL import Image, ImageOps, UnidentifiedImageError, features

logger = logging.getLogger(__name__)

pillow_heif.register_heif_opener()  # Image.open reads HEIC/HEIF from here on
if not features.check("avif"):  # pragma: no cover - the locked Pillow wheels carry libavif
    raise ImportError("this Pillow was built without AVIF support; install the locked pillow")

# The file name endings of the formats load_image decodes (lower case).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".heic", ".heif", ".avif")

DEFAULT_MAX_PIXELS = 50_000_000  # ~ 8660 x 5770; larger headers are refused before decoding


class ImageReadError(ValueError):
    """The source is not a readable image (not an image, truncated, or too large): the damaged kind
    itself, or one of the kinds below."""


class NotAnImageError(ImageReadError):
    """The source is no image format Pillow knows."""


class ImageTooLargeError(ImageReadError):
    """The image has more pixels than allowed (refused before decoding) or is a decompression bomb."""


@dataclass(frozen=True)
class Photo:
    """A picture as decoded for reading (``read_image``), perhaps at a reduced size, and the size of the
    picture itself (EXIF orientation applied): what its fragments' boxes are given in."""

    image: Image.Image
    width: int
    height: int
    digest: str = ""  # sha256 of the file's bytes where it was read from bytes (an upload), else empty


def load_image(
    source: Path | str | bytes, max_pixels: int = DEFAULT_MAX_PIXELS, name: str | None = None
) -> Image.Image:
    """Decode an image fully into RGB (EXIF orientation applied, alpha composited on white).

    The pixel count in the header is checked against ``max_pixels`` before any decoding.
    Raises NotAnImageError for a non-image, ImageTooLargeError for an oversized image and
    ImageReadError for a truncated or otherwise unreadable file; the message starts
    with ``name`` (default: the path, or the byte count).
    """
    return read_image(source, max_pixels, name).image


def read_image(
    source: Path | str | bytes, max_pixels: int = DEFAULT_MAX_PIXELS, name: str | None = None, side: int = 0
) -> Photo:
    """``load_image``, decoding a JPEG larger than ``side`` at a reduced size: the largest of 1/2, 1/4 and
    1/8 whose longer side is still at least ``side`` (the decoder's DCT scaling, Pillow's ``draft``), so a
    12 MP photo costs a fraction of its full decode. Other formats, and ``side`` 0, decode in full. The
    image is not resized further (that is the reader's: model/image.py ``working_image``); the Photo
    carries the picture's own size."""
    label = name or (f"<{len(source)} bytes>" if isinstance(source, bytes) else str(source))
    try:
        fp = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")  # noqa: SIM115
    except OSError as e:
        raise ImageReadError(f"{label}: cannot open ({e.strerror or e})") from e
    with fp:
        img: Image.Image
        try:
            img = Image.open(fp)
        except UnidentifiedImageError as e:
            raise NotAnImageError(f"{label}: not a recognised image format") from e
        except Image.DecompressionBombError as e:
            raise ImageTooLargeError(f"{label}: image too large ({e})") from e
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise ImageReadError(f"{label}: unreadable image header ({e})") from e
        width, height = img.size
        if width < 1 or height < 1:
            raise ImageReadError(f"{label}: empty image ({width}x{height})")
        if width * height > max_pixels:
            raise ImageTooLargeError(
                f"{label}: image too large ({width}x{height} = {width * height} pixels > {max_pixels})"
            )
        if side and max(width, height) > side:  # JPEG and MPO (phones' JPEGs) reduce; other formats ignore it
            fit = side / max(width, height)  # the smallest decode that keeps the longer side >= side
            img.draft(None, (max(1, int(width * fit)), max(1, int(height * fit))))
        decoded = img.size
        try:
            img.load()
        except Image.DecompressionBombError as e:
            raise ImageTooLargeError(f"{label}: image too large ({e})") from e
        except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
            raise ImageReadError(f"{label}: truncated or corrupt image data ({e})") from e
    try:
        img = ImageOps.exif_transpose(img) or img
    except Exception:  # a malformed EXIF block should not reject an otherwise good image
        logger.debug("%s: ignoring unreadable EXIF orientation", label)
    turned = img.size != decoded and img.size == decoded[::-1]  # an orientation that swaps the sides
    digest = hashlib.sha256(source).hexdigest() if isinstance(source, bytes) else ""
    return Photo(_to_rgb(img), *((height, width) if turned else (width, height)), digest)


def longer_side(data: bytes) -> int:
    """The longer side of the picture in ``data`` from its header (nothing decoded); 0 when it has none."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return max(img.size)
    except Exception:  # not an image, or a damaged one: reading it fails later, with its reason
        return 0


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")
