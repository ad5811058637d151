"""An image's cached features on disk: the key of the settings that shaped them (the cache folder),
the key of the image's content (the entry's name) and the entry format (one ``.npz``: boxes, float16
features, the image's size), written atomically. Read by the feature cache (model/cache.py), the
extraction workers (model/extraction.py) and the index's fragment shards (index/shards.py); and the one reader of a
picture's bytes as the model reads them (``PhotoReader``: its entry's key and the picture at the model's side)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.model.atomic import atomic_file
from fragsearch.model.config import IMAGE_FIELDS_ADDED_LATER, ImageConfig
from fragsearch.model.detector import DETECTOR_NAME, N_CLASSES, label_of
from fragsearch.model.graphs import FEATURE_DIM, quant_recipe, weights_digest
from fragsearch.model.image import ImageFragments
from fragsearch.model.imageio import DEFAULT_MAX_PIXELS, Photo, longer_side, read_image
from fragsearch.model.places import DEFAULT_PLACES, Places

FEATURE_VERSION = 2  # bump when the extraction code changes its output for the same settings


def config_payload(cfg: ImageConfig, places: Places = DEFAULT_PLACES) -> dict[str, Any]:
    """Everything that shapes the features: every ImageConfig field, the backbone (for a fine-tuned one the
    digest of its weights, not their path: read against the artifacts folder of `places`), the version, for the
    int8 backbone its quantization recipe, and the mirrored training view when it is one."""
    image = dataclasses.asdict(cfg)
    later = {name: image.pop(name) for name in IMAGE_FIELDS_ADDED_LATER}  # each in its own form below, where set
    weights = image.pop("backbone_weights")  # not in the payload for the ImageNet weights: their keys stay
    if later["detector_classes"]:
        image["detector_classes"] = True
    if later["proposals"] != "selective_search":  # the region source and its floor
        image["proposals"] = later["proposals"]
        image["detector"] = DETECTOR_NAME
        if later["proposals"] == "detector_topup":
            image["detector_floor"] = later["detector_floor"]
    # the backbone beside the image settings, as before it was one (Lite0's keys stay); decode_side is in the
    # entries' keys of the pictures it reduces (content_key), not here
    payload: dict[str, Any] = {"image": image, "backbone": later["backbone"], "version": FEATURE_VERSION}
    if later["mirror"]:
        payload["mirror"] = True
    if later["region_ranker"]:
        payload["region_ranker"] = later["region_ranker"]  # named by its content (model/regions.py ranker_name)
    if later["head_regions"]:
        payload["head_regions"] = [later["head_regions"], later["head_min_box_frac"]]
    if weights:
        payload["backbone_weights"] = weights_digest(weights, places)  # the bytes, not the path
    if cfg.backbone_precision == "int8":
        payload["quantization"] = quant_recipe()
    return payload


def feature_dim(cfg: ImageConfig) -> int:
    """The width of a fragment's features under ``cfg``: the CNN's 1280, and the detector's 90 class scores
    with ``cfg.detector_classes``."""
    return FEATURE_DIM + (N_CLASSES if cfg.detector_classes else 0)


def fragment_labels(features: np.ndarray, cfg: ImageConfig) -> tuple[str | None, ...]:
    """An image's fragment features (F, D) → the COCO name of each fragment's confident detector class
    (model/detector.py ``label_of``), None where there is none; the whole image (row 0) has no label. Empty
    when ``cfg`` has no detector classes (nothing to name a region by)."""
    if not cfg.detector_classes:
        return ()
    if features.shape[-1] != feature_dim(cfg):
        raise ValueError(f"fragment features of width {features.shape[-1]}, expected {feature_dim(cfg)} "
                         "(the CNN's and the detector's class scores)")
    return (None, *(label_of(row[FEATURE_DIM:]) for row in features[1:]))


def config_key(cfg: ImageConfig, places: Places = DEFAULT_PLACES) -> str:
    """Short hash of `config_payload`: the name of the cache folder for these settings."""
    return hashlib.sha256(json.dumps(config_payload(cfg, places), sort_keys=True).encode()).hexdigest()[:12]


def content_key(data: bytes, decode_side: int = 0) -> str:
    """The name of an image's entry: a hash of its file's bytes; of a picture whose longer side exceeds
    ``decode_side`` (``ImageConfig.decode_side``: read at that side), a hash of its bytes and the side, so
    its entries at two sides never mix and the entries of smaller pictures keep their keys."""
    digest = hashlib.sha256(data)
    if decode_side and longer_side(data) > decode_side:
        digest.update(f"\0decode_side={decode_side}".encode())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class PhotoReader:
    """How the model reads a picture's bytes: the key of its feature-cache entry and the picture decoded for
    reading (a JPEG larger than ``decode_side``, ``ImageConfig.decode_side``, at a reduced size: the decoder's
    scaling, model/imageio.py ``read_image``). The one place the reading side meets the bytes: the extraction
    workers, the feature cache, the bulk indexer, the service's uploads and the terminal's annotate read
    through it. ``max_pixels``: the largest picture accepted."""

    decode_side: int
    max_pixels: int = DEFAULT_MAX_PIXELS

    @classmethod
    def of(cls, cfg: ImageConfig, max_pixels: int = DEFAULT_MAX_PIXELS) -> PhotoReader:
        return cls(cfg.decode_side, max_pixels)

    def key(self, data: bytes) -> str:
        """The name of the picture's entry in the feature cache (``content_key``)."""
        return content_key(data, self.decode_side)

    def read(self, source: bytes | Path | str, name: str | None = None, full: bool = False) -> Photo:
        """The picture decoded for reading; with ``full`` at its own size (a copy to store). ImageReadError
        (or a subclass) when it cannot be."""
        return read_image(source, max_pixels=self.max_pixels, name=name, side=0 if full else self.decode_side)


def entry_name(item: str | Path) -> str:
    """How an image is named in reports and ``failed.json``: its file name."""
    name = Path(item).name
    if name in ("", ".", ".."):
        raise ValueError(f"not a usable image name: {item!r}")
    return name


def write_entry(path: Path, frag: ImageFragments) -> None:
    """Store one image's fragments (features as float16) atomically."""
    with atomic_file(path) as fh:
        np.savez(
            fh,
            boxes=frag.boxes.astype(np.float32),
            features=frag.features.astype(np.float16),
            size=np.asarray([frag.width, frag.height], dtype=np.int64),
        )


def read_entry(path: Path) -> ImageFragments:
    """One cached entry back as ImageFragments (features float32)."""
    with np.load(path) as z:
        width, height = (int(v) for v in z["size"])
        return ImageFragments(z["boxes"].astype(np.float32), z["features"].astype(np.float32), width, height)
