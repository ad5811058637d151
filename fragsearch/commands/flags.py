"""Command-line flags made from the settings' fields.

- The index settings, from the fields of `IndexShape` and `SearchSettings` (their defaults, types, choices and
  help): one `--name` a field (`--k-prime`, `--store-dtype`, ...), read back as `IndexSettings`. A flag set with a
  prefix (`--sentence-k-prime`) sets the same field of a second index's settings.
- The image fragments' settings (`ImageConfig`): `--region-features`, `--crop-size`, ..., each overriding a
  variant's only where given (`with_region_flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable

from fragsearch.index.types import SAVED_ORDER, IndexSettings, IndexShape, SearchSettings
from fragsearch.model.config import (
    BACKBONE_NAMES,
    BACKBONE_PRECISIONS,
    PROPOSAL_MODES,
    PROPOSAL_SOURCES,
    REGION_FEATURES,
    ImageConfig,
)


def _fields() -> dict[str, dataclasses.Field[object]]:
    both = {f.name: f for f in (*dataclasses.fields(IndexShape), *dataclasses.fields(SearchSettings))}
    return {name: both[name] for name in SAVED_ORDER}


def _dest(prefix: str, name: str) -> str:
    return f"index_{prefix.replace('-', '_')}{name}"


def add_index_flags(ap: argparse.ArgumentParser, defaults: IndexSettings, names: Iterable[str] | None = None,
                    prefix: str = "", what: str = "") -> None:
    """One flag per field named (default: every field of both types) with `defaults`' values; `prefix`
    ("sentence-") and `what` ("sentence index: ") for a second index's flags."""
    fields = _fields()
    values = defaults.to_dict()
    group = ap.add_argument_group(f"{what.rstrip(': ') or 'index'} settings (IndexShape: saved with the index, "
                                  "a rebuild to change; SearchSettings: per search)")
    for name in fields if names is None else names:
        f = fields[name]
        default = values[name]
        flag = f"--{prefix}{name.replace('_', '-')}"
        text = f"{what}{f.metadata['help']}"
        if isinstance(default, bool):
            group.add_argument(flag, dest=_dest(prefix, name), action=argparse.BooleanOptionalAction,
                               default=default, help=text)
        else:
            group.add_argument(flag, dest=_dest(prefix, name), type=type(default), default=default,
                               choices=f.metadata["choices"], metavar=None if f.metadata["choices"] else name.upper(),
                               help=f"{text} (default {default!r})")


def index_settings_of(args: argparse.Namespace, base: IndexSettings, prefix: str = "") -> IndexSettings:
    """`base` with every field whose flag `add_index_flags` added (with `prefix`) set from `args`."""
    values = base.to_dict()
    for name in values:
        dest = _dest(prefix, name)
        if hasattr(args, dest):
            values[name] = getattr(args, dest)
    return IndexSettings.of(**values)


def add_region_flags(ap: argparse.ArgumentParser, defaults: ImageConfig | None) -> None:
    """The image-fragment flags (--region-features, --crop-size, --min-box-frac, --backbone-size,
    --backbone-precision, --backbone, --proposal-mode, --proposal-resize, --proposals, --detector-floor,
    --detector-classes, --region-ranker, --head-regions, --head-min-box-frac); with `defaults` None each is None
    unless given (the run's own settings are kept, see `with_region_flags`)."""
    ap.add_argument("--region-features", choices=REGION_FEATURES, default=defaults and defaults.region_features,
                    help="roi_align: pooled from one backbone pass; crop: a backbone pass per region")
    ap.add_argument("--crop-size", type=int, default=defaults and defaults.crop_size,
                    help="side regions are warped to with --region-features crop")
    ap.add_argument("--min-box-frac", type=float, default=defaults and defaults.min_box_frac,
                    help="smallest region side as a fraction of the image side")
    ap.add_argument("--backbone-size", type=int, default=defaults and defaults.backbone_size,
                    help="side of the one backbone pass (roi_align features; proposal scoring with crops)")
    ap.add_argument("--backbone-precision", choices=BACKBONE_PRECISIONS,
                    default=defaults and defaults.backbone_precision,
                    help="fp32, or int8: the quantized backbone graph")
    ap.add_argument("--backbone", choices=BACKBONE_NAMES, default=defaults and defaults.backbone,
                    help="the fragments' CNN (crop features; --crop-size its native side: 240 / 260)")
    ap.add_argument("--proposal-mode", choices=PROPOSAL_MODES,
                    default=defaults and defaults.proposal_mode, help="selective search strategy set")
    ap.add_argument("--proposal-resize", type=int, default=defaults and defaults.proposal_resize,
                    help="longer side the image is resized to for selective search")
    ap.add_argument("--proposals", choices=PROPOSAL_SOURCES, default=defaults and defaults.proposals,
                    help="regions from selective search, the COCO detector, or the detector topped up with "
                         "selective search")
    ap.add_argument("--detector-floor", type=float, default=defaults and defaults.detector_floor,
                    help="with --proposals detector_topup: the smallest detection score kept as a region")
    ap.add_argument("--detector-classes", action="store_true", default=defaults and defaults.detector_classes,
                    help="with detector proposals: each fragment's features carry the detector's class scores")
    ap.add_argument("--region-ranker", default=defaults and defaults.region_ranker,
                    help="the region ranker's file name (region-ranker-<digest>.npz, training/regions.py) that orders "
                         "selective search's proposals; empty: the ImageNet head's objectness")
    ap.add_argument("--head-regions", type=int, default=defaults and defaults.head_regions,
                    help="with --region-ranker: how many of the regions the ImageNet head chooses first (among "
                         "boxes with sides of at least --head-min-box-frac); the ranker chooses the rest")
    ap.add_argument("--head-min-box-frac", type=float, default=defaults and defaults.head_min_box_frac,
                    help="with --head-regions: the smallest side of the head's regions, as a fraction of the image's")


REGION_FLAGS = ("region_features", "crop_size", "min_box_frac", "backbone_size", "backbone_precision",
                "backbone", "proposal_mode", "proposal_resize", "proposals", "detector_floor", "detector_classes",
                "region_ranker", "head_regions", "head_min_box_frac")


def with_region_flags(cfg: ImageConfig, args: argparse.Namespace) -> ImageConfig:
    """`cfg` with the region flags that were set (see `add_region_flags`)."""
    given = {k: getattr(args, k) for k in REGION_FLAGS}
    return dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None})
