"""When and where a photo was taken, from its EXIF block, and the date and place filters of a search.

`read_place` reads the date taken (DateTimeOriginal, else DateTimeDigitized, else the IFD0 DateTime)
and the GPS position with Pillow's EXIF reader; a file without EXIF (or with a damaged block) has
neither, which is not an error. EXIF dates carry no time zone: they are stored as written, read as
UTC (seconds since 1970), and the filters compare them the same way, so "taken after 2024-06-01"
means the camera's clock said so.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

logger = logging.getLogger(__name__)

EXIF_IFD, GPS_IFD = 0x8769, 0x8825
DATETIME, DATETIME_ORIGINAL, DATETIME_DIGITIZED = 306, 36867, 36868
GPS_LAT_REF, GPS_LAT, GPS_LON_REF, GPS_LON = 1, 2, 3, 4
EARTH_KM = 6371.0088  # mean Earth radius
KM_PER_DEGREE = math.pi * EARTH_KM / 180.0


@dataclass(frozen=True)
class Place:
    """taken: seconds since 1970 (the EXIF clock read as UTC); lat, lon: degrees. None when unknown."""

    taken: float | None = None
    lat: float | None = None
    lon: float | None = None


def _datetime(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        when = datetime.strptime(text.strip().rstrip("\x00")[:19], "%Y:%m:%d %H:%M:%S")
    except ValueError:
        return None
    return when.replace(tzinfo=UTC).timestamp()


def _degrees(value: Any, ref: Any) -> float | None:
    try:
        d, m, s = (float(v) for v in value)
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    out = d + m / 60.0 + s / 3600.0
    if isinstance(ref, bytes):
        ref = ref.decode("ascii", "replace")
    if isinstance(ref, str) and ref.strip().upper() in ("S", "W"):
        out = -out
    return out if math.isfinite(out) else None


def read_place(path: Path | str) -> Place:
    """The date taken and GPS position in the file's EXIF block (each None when absent or unreadable)."""
    try:
        with Image.open(path) as im:
            exif = im.getexif()
            sub = exif.get_ifd(EXIF_IFD)
            gps = exif.get_ifd(GPS_IFD)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as e:
        logger.debug("no EXIF read from %s: %s", path, e)
        return Place()
    taken = _datetime(sub.get(DATETIME_ORIGINAL)) or _datetime(sub.get(DATETIME_DIGITIZED)) or \
        _datetime(exif.get(DATETIME))
    lat = _degrees(gps.get(GPS_LAT), gps.get(GPS_LAT_REF)) if gps else None
    lon = _degrees(gps.get(GPS_LON), gps.get(GPS_LON_REF)) if gps else None
    if lat is None or lon is None or not (-90 <= lat <= 90 and -180 <= lon <= 180):
        lat = lon = None
    return Place(taken, lat, lon)


def distance_km(lat: np.ndarray | float, lon: np.ndarray | float, lat0: float, lon0: float) -> np.ndarray:
    """Great-circle distance (haversine) from (lat0, lon0) to each (lat, lon), in km."""
    p1, p2 = np.radians(lat0), np.radians(np.asarray(lat, dtype=np.float64))
    dp, dl = p2 - p1, np.radians(np.asarray(lon, dtype=np.float64) - lon0)
    a = np.sin(dp / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dl / 2) ** 2
    return np.asarray(2 * EARTH_KM * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0))))


@dataclass(frozen=True)
class Near:
    lat: float
    lon: float
    km: float


@dataclass(frozen=True)
class PlaceFilter:
    """Keep images taken at or after `taken_after` and before `taken_before` (seconds, as Place.taken),
    within `near.km` of (near.lat, near.lon). An image without the date (or position) fails a filter
    on it."""

    taken_after: float | None = None
    taken_before: float | None = None
    near: Near | None = None

    def __bool__(self) -> bool:
        return self.taken_after is not None or self.taken_before is not None or self.near is not None

    def sql(self) -> tuple[str, list[float]]:
        """A condition on the catalogue's taken / lat / lon columns that every kept image meets (the
        position by its latitude band only: `keeps` checks the distance)."""
        parts: list[str] = []
        params: list[float] = []
        if self.taken_after is not None:
            parts.append("taken >= ?")
            params.append(self.taken_after)
        if self.taken_before is not None:
            parts.append("taken < ?")
            params.append(self.taken_before)
        if self.near is not None:
            band = self.near.km / KM_PER_DEGREE
            parts.append("lat BETWEEN ? AND ? AND lon IS NOT NULL")
            params += [self.near.lat - band, self.near.lat + band]
        return " AND ".join(parts) or "1", params

    def keeps(self, taken: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
        """Which of the images (NaN where unknown) pass: a boolean mask."""
        keep = np.ones(len(taken), dtype=bool)
        with np.errstate(invalid="ignore"):
            if self.taken_after is not None:
                keep &= taken >= self.taken_after
            if self.taken_before is not None:
                keep &= taken < self.taken_before
            if self.near is not None:
                keep &= distance_km(lat, lon, self.near.lat, self.near.lon) <= self.near.km
        return keep
