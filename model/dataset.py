"""A split ready for training or evaluation: cached image features + parsed captions."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fragsearch.model.cache import FeatureCache
from fragsearch.model.config import ImageConfig
from fragsearch.model.data import Split, load_split
from fragsearch.model.fragments import parse_cached
from fragsearch.model.places import DEFAULT_ARTIFACTS, Places
from fragsearch.model.text import ParsedSentence, Parser

logger = logging.getLogger(__name__)


@dataclass
class SplitData:
    """feats: (N, F, img_dim) region features, boxes: (N, F, 4); sentence l describes image pair_image[l];
    mirrored: the same images' mirrored training view (ImageConfig.mirror), when it was loaded."""

    split: Split
    feats: np.ndarray
    boxes: np.ndarray
    sentences: list[str]
    pair_image: np.ndarray
    parsed: list[ParsedSentence]
    mirrored: np.ndarray | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return self.split.images


def select_images(data: SplitData, keep: np.ndarray) -> SplitData:
    """The images `keep` (indices, kept in split order) with all their captions and parses."""
    keep = np.unique(np.asarray(keep, dtype=np.int64))
    new_id = np.full(len(data.names), -1, dtype=np.int64)
    new_id[keep] = np.arange(len(keep))
    rows = np.flatnonzero(new_id[data.pair_image] >= 0)
    sp = Split(data.split.root, tuple(data.names[k] for k in keep), tuple(data.split.captions[k] for k in keep))
    return SplitData(sp, data.feats[keep], data.boxes[keep], [data.sentences[i] for i in rows],
                     new_id[data.pair_image[rows]], [data.parsed[i] for i in rows],
                     None if data.mirrored is None else data.mirrored[keep])


def held_out_indices(n_images: int, n: int, seed: int) -> np.ndarray:
    """The indices (in split order) of the `n` images `hold_out` holds out of `n_images` with `seed`."""
    return np.random.default_rng(seed).choice(n_images, size=n, replace=False)


def hold_out(data: SplitData, n: int, seed: int) -> tuple[SplitData, SplitData]:
    """(the rest, `n` images drawn with `seed`): an image-disjoint split of `data`, each image with all
    its captions. The same `data`, `n` and `seed` always hold out the same images."""
    held = np.zeros(len(data.names), dtype=bool)
    held[held_out_indices(len(data.names), n, seed)] = True
    return select_images(data, np.flatnonzero(~held)), select_images(data, np.flatnonzero(held))


def held_out_split(split: Split, n: int, seed: int) -> Split:
    """The `n` images (with their captions) that `hold_out` holds out of `split` with `seed`, in split order:
    the validation part without reading the rest's features."""
    keep = np.sort(held_out_indices(len(split.images), n, seed))
    return Split(split.root, tuple(split.images[k] for k in keep), tuple(split.captions[k] for k in keep))


def feature_cache(cache_root: Path, image_cfg: ImageConfig, device: str = "cpu",
                  artifacts: Path = DEFAULT_ARTIFACTS) -> FeatureCache:
    """The shared feature cache under the cache folder `cache_root` (the `cache` setting): always the full
    1 + n_regions fragments (full-frame models slice row 0); its extractor's graphs are those of the same cache
    folder (`Places(artifacts, cache_root)`)."""
    return FeatureCache(Path(cache_root) / "features", dataclasses.replace(image_cfg, full_frame_only=False),
                        device=device, places=Places(artifacts, Path(cache_root)))


def load_split_data(root: Path, split: str | Path | Split, image_cfg: ImageConfig, cache_root: Path,
                    parser: Parser, workers: int = 1, limit: int | None = None, device: str = "cpu") -> SplitData:
    """Extract (or reuse, the backbone on `device`) the features of a split's images and parse (or reuse)
    its captions (`split`: a name, a split list's path, or a Split read already).

    Unreadable images are skipped and counted, with their captions.
    """
    sp = split if isinstance(split, Split) else load_split(root, split)
    if limit is not None:
        sp = sp.subset(limit)
    cache = feature_cache(cache_root, image_cfg, device)
    report = cache.ensure([sp.image_path(n) for n in sp.images], workers=workers)
    if report.failed:
        bad = {Path(name).name for name, _ in report.failed}
        logger.warning("%d unreadable images skipped: %s", len(bad), ", ".join(sorted(bad)[:5]))
        keep = [k for k, n in enumerate(sp.images) if n not in bad]
        sp = Split(sp.root, tuple(sp.images[k] for k in keep), tuple(sp.captions[k] for k in keep))
    feats, boxes = cache.load_arrays([sp.image_path(n) for n in sp.images])
    sentences, pair = sp.sentences()
    parsed = parse_cached(parser, sentences, Path(cache_root) / "parses")
    return SplitData(sp, feats, boxes, sentences, np.asarray(pair, dtype=np.int64), parsed)


def cached_features(cache_root: Path, image_cfg: ImageConfig, paths: Sequence[Path], workers: int = 1,
                    device: str = "cpu", what: str = "features") -> tuple[np.ndarray, np.ndarray]:
    """(features, boxes) of every image in `paths`, in order, with `image_cfg`: extracted into the cache
    where missing; ValueError naming `what` when an image has none."""
    cache = feature_cache(cache_root, image_cfg, device)
    report = cache.ensure(list(paths), workers=workers)
    if report.failed:
        raise ValueError(f"{len(report.failed)} images have no {what}: {report.failed[:3]}")
    return cache.load_arrays(list(paths))


def with_mirrored(data: SplitData, image_cfg: ImageConfig, cache_root: Path, workers: int = 1,
                  device: str = "cpu") -> SplitData:
    """`data` with its images' mirrored view (`image_cfg` with mirror: every crop flipped left to right,
    the same boxes), extracted into its own cache folder where missing."""
    mirrored, boxes = cached_features(cache_root, dataclasses.replace(image_cfg, mirror=True),
                                      [data.split.image_path(n) for n in data.names], workers, device,
                                      "mirrored view")
    if mirrored.shape != data.feats.shape or not np.allclose(boxes, data.boxes):
        raise ValueError("the mirrored view's boxes are not the images' boxes: extracted with other settings")
    return dataclasses.replace(data, mirrored=mirrored)
