"""Model selection's data: the validation part held out of the training images (never dev) and the
metrics kept per evaluated epoch. Training (training/train.py), merges (training/merge.py) and the
fine-tuned CNN (training/finetune.py) select on the same part."""

from __future__ import annotations

import logging

from fragsearch.model.config import SELECTIONS, TrainConfig
from fragsearch.model.dataset import SplitData, hold_out

logger = logging.getLogger(__name__)

VAL_METRICS = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10", "annot_medr",
               "search_medr")  # kept per evaluated epoch in the history, as val_<name>


def split_for_selection(cfg: TrainConfig, data: SplitData) -> tuple[SplitData, SplitData | None]:
    """(what is trained on, the validation part or None): `cfg.val_images` training images held out
    with `cfg.val_seed` for --selection val, nothing for --selection last."""
    if cfg.selection == "last":
        return data, None
    if cfg.selection != "val":
        raise ValueError(f"unknown selection {cfg.selection!r}: one of {', '.join(SELECTIONS)}")
    if not 0 < cfg.val_images < len(data.names) // 2:
        raise ValueError(f"cannot hold out {cfg.val_images} of {len(data.names)} training images for validation "
                         "(at most half): pass a smaller --val-images, or --selection last")
    rest, val = hold_out(data, cfg.val_images, cfg.val_seed)
    logger.info("model selection on %d training images held out with their %d captions (seed %d); training on %d",
                len(val.names), len(val.sentences), cfg.val_seed, len(rest.names))
    return rest, val
