"""The region ranker: which of an image's proposals to keep as its 19 regions.

Selective search proposes a hundred or so boxes per image; the extractor keeps ``n_regions`` of them after NMS
(model/proposals.py ``select_regions``), best first. Ranked by the ImageNet head's confidence on each box (an
objectness proxy), the kept regions hold a box that people drew for a phrase (Flickr30k Entities, IoU >= 0.5)
for about two phrases in three, though the proposals hold one for five in six: the head was trained to name
ImageNet's 1,000 classes, not to find what people describe.

The ranker is a small head trained for that question on the training images' Entities boxes
(training/regions.py): for each proposal it reads the ranking backbone's pooled features of the box (the same
one-sample-per-bin RoI pooling the extractor ranks with, 1,280 numbers) and the box's geometry in the image
(``geometry``: corners, sides, log area, log aspect, centre), standardised by the training set's mean and
spread, through one hidden layer (ReLU) to a logit: how likely the box is one someone named. The extractor
keeps the proposals in that order (NMS as before).

Its arrays are one ``.npz`` file (``FORM``), named by their content (``ranker_name``) and found as the
backbone's files are (the release folder, then the graph folder, model/graphs.py ``find``); an image config
names it (``ImageConfig.region_ranker``), and the name is in the feature cache's key.
"""

from __future__ import annotations

import hashlib
import io
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fragsearch.model.atomic import atomic_file

FORM = "region-ranker-1"
GEOMETRY = 10  # the numbers of a box's geometry (``geometry``)
PREFIX = "region-ranker-"


class RankerError(ValueError):
    """A region ranker file that cannot be used."""


def geometry(boxes: np.ndarray, width: int, height: int) -> np.ndarray:
    """Boxes (P, 4) [x0, y0, x1, y1] in an image of width x height → (P, GEOMETRY) float32: the corners as
    fractions of the sides, the box's sides, log area and log aspect (of the fractions), its centre."""
    b = np.asarray(boxes, np.float32).reshape(-1, 4)
    x0, y0 = b[:, 0] / width, b[:, 1] / height
    x1, y1 = b[:, 2] / width, b[:, 3] / height
    bw, bh = np.maximum(x1 - x0, 1e-3), np.maximum(y1 - y0, 1e-3)
    return np.stack([x0, y0, x1, y1, bw, bh, np.log(bw * bh), np.log(bw / bh), (x0 + x1) / 2, (y0 + y1) / 2],
                    axis=1).astype(np.float32)


@dataclass(frozen=True)
class RegionRanker:
    """The ranker's arrays: inputs standardised by (``mean``, ``scale``), then ``w1`` (D, H), ``b1`` (H,),
    ReLU, ``w2`` (H,), ``b2`` (a number)."""

    mean: np.ndarray
    scale: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: float

    def __post_init__(self) -> None:
        d, hidden = self.w1.shape
        if self.mean.shape != (d,) or self.scale.shape != (d,) or self.b1.shape != (hidden,) \
                or self.w2.shape != (hidden,):
            raise RankerError(f"region ranker arrays of mismatched shapes: w1 {self.w1.shape}, mean "
                              f"{self.mean.shape}, scale {self.scale.shape}, b1 {self.b1.shape}, w2 {self.w2.shape}")
        if d <= GEOMETRY:
            raise RankerError(f"a region ranker reads pooled features and {GEOMETRY} numbers of geometry: {d} inputs")
        if not np.all(self.scale > 0):
            raise RankerError("a region ranker's scales must be positive")

    @property
    def features(self) -> int:
        """The width of the pooled features it reads."""
        return int(self.w1.shape[0]) - GEOMETRY

    def inputs(self, pooled: np.ndarray, boxes: np.ndarray, width: int, height: int) -> np.ndarray:
        """Pooled features (P, D) and their boxes (P, 4) → the standardised inputs (P, D + GEOMETRY)."""
        pooled = np.asarray(pooled, np.float32).reshape(len(boxes), -1)
        if pooled.shape[1] != self.features:
            raise RankerError(f"the region ranker reads {self.features} pooled features per box, got "
                              f"{pooled.shape[1]}")
        x = np.concatenate([pooled, geometry(boxes, width, height)], axis=1)
        out: np.ndarray = ((x - self.mean) / self.scale).astype(np.float32)
        return out

    def score(self, pooled: np.ndarray, boxes: np.ndarray, width: int, height: int) -> np.ndarray:
        """(P,) float32 logits: the higher, the likelier the box is one someone named."""
        if not len(boxes):
            return np.zeros((0,), np.float32)
        hidden = np.maximum(self.inputs(pooled, boxes, width, height) @ self.w1 + self.b1, 0.0)
        out: np.ndarray = (hidden @ self.w2 + np.float32(self.b2)).astype(np.float32)
        return out

    def to_bytes(self) -> bytes:
        """The ``.npz`` bytes of the ranker (float32 arrays and its form)."""
        buf = io.BytesIO()
        np.savez(buf, form=np.asarray(FORM), mean=self.mean.astype(np.float32), scale=self.scale.astype(np.float32),
                 w1=self.w1.astype(np.float32), b1=self.b1.astype(np.float32), w2=self.w2.astype(np.float32),
                 b2=np.asarray(self.b2, np.float32))
        return buf.getvalue()

    def name(self) -> str:
        """The file name its arrays are stored under: ``region-ranker-<12 hex of their digest>.npz``."""
        return ranker_name(self.to_bytes())

    def save(self, folder: Path) -> Path:
        """Write the arrays into ``folder`` under ``name()`` (atomically); the path."""
        data = self.to_bytes()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / ranker_name(data)
        with atomic_file(path) as fh:
            fh.write(data)
        return path


def ranker_name(data: bytes) -> str:
    """The file name of a ranker's ``.npz`` bytes."""
    return f"{PREFIX}{hashlib.sha256(data).hexdigest()[:12]}.npz"


def read_ranker(path: Path) -> RegionRanker:
    """A ranker from its file; RankerError when it is not one (wrong form, arrays missing or mismatched)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            form = str(z["form"]) if "form" in z.files else ""
            if form != FORM:
                raise RankerError(f"{path}: not a region ranker of form {FORM!r} (form {form!r})")
            return RegionRanker(z["mean"].astype(np.float32), z["scale"].astype(np.float32),
                                z["w1"].astype(np.float32), z["b1"].astype(np.float32), z["w2"].astype(np.float32),
                                float(z["b2"]))
    except (OSError, KeyError, ValueError) as e:
        if isinstance(e, RankerError):
            raise
        raise RankerError(f"{path}: not a readable region ranker ({e})") from e


_lock = threading.Lock()
_loaded: dict[str, RegionRanker] = {}


def load_ranker(name: str, folder: Path | None = None) -> RegionRanker:
    """The ranker an image config names (``ImageConfig.region_ranker``), found where the backbone's files are
    (model/graphs.py ``find``: the release folder, then ``folder`` or the graph folder), read once per process.
    FileNotFoundError naming where it was looked for when it is nowhere."""
    from fragsearch.model.graphs import find, search_dirs

    if not name.startswith(PREFIX) or not name.endswith(".npz") or Path(name).name != name:
        raise RankerError(f"not a region ranker's file name: {name!r} (expected {PREFIX}<digest>.npz)")
    key = f"{folder}:{name}"
    with _lock:
        if key not in _loaded:
            path = find(name, folder)
            if path is None:
                where = " or ".join(str(d) for d in search_dirs(folder))
                raise FileNotFoundError(f"the region ranker {name} is in neither {where}: train it with "
                                        "`python -m fragsearch.training.regions` or install the release that ships it")
            ranker = read_ranker(path)
            if ranker_name(path.read_bytes()) != name:
                raise RankerError(f"{path}: its content does not match its name")
            _loaded[key] = ranker
        return _loaded[key]
