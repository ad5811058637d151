"""Decoding image files and uploads into RGB PIL images, with clear errors for bad input.

Only Pillow and NumPy: the service's upload path imports this, not the extractor (OpenCV, torch).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

logger = logging.getLogger(__name__)

DEFAULT_MAX_PIXELS = 50_000_000  # ~ 8660 x 5770; larger headers are refused before decoding


class ImageReadError(ValueError):
    """The source is not a readable image (not an image, truncated, or too large): the damaged kind
    itself, or one of the kinds below."""


class NotAnImageError(ImageReadError):
    """The source is no image format Pillow knows."""


class ImageTooLargeError(ImageReadError):
    """The image has more pixels than allowed (refused before decoding) or is a decompression bomb."""


def load_image(
    source: Path | str | bytes, max_pixels: int = DEFAULT_MAX_PIXELS, name: str | None = None
) -> Image.Image:
    """Decode an image fully into RGB (EXIF orientation applied, alpha composited on white).

    The pixel count in the header is checked against ``max_pixels`` before any decoding.
    Raises NotAnImageError for a non-image, ImageTooLargeError for an oversized image and
    ImageReadError for a truncated or otherwise unreadable file; the message starts
    with ``name`` (default: the path, or the byte count).
    """
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
    return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")
