"""Trained fragment models as a teacher: their S_kl over each training batch as soft targets.

The teacher is usually a merged ensemble (training/merge.py: members side by side, each thresholded
apart), the student a model of the served size trained by the same recipe. Per batch the teacher
scores the batch's images against its sentences with the one S_kl (model.score.skl, its own blocks),
and `fragsearch.training.objectives.distill_loss` pulls the student's batch scores towards the teacher's
ranking, in both directions, beside the fragment and global objectives (`TrainConfig.distill_weight`).

A teacher may be several checkpoints (`TrainConfig.distill_from` "a.pt,b.pt"): its score is the sum of
theirs, each thresholded apart as a merge's members are, and each reads its own image features: a
checkpoint trained on other regions or another backbone (the detector's regions, Lite1 crops) reads
its features of the same training images from the feature cache, extracted there where missing. The
student's serving cost stays its own; only training reads the teacher's features. Every part must read
the student's words and relations (its checkpoint's word table and relation vocabulary); ValueError
otherwise. The image fragments are embedded once for every training image (no dropout: the teacher
is evaluated); the sentence fragments per batch, from the batch's own triplets. Raw S_kl: the
teacher's calibration is left out (it scales each item against reference fragments, a cost per batch
that would buy the soft targets nothing: they are standardised within each batch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fragsearch.model.config import ImageConfig
from fragsearch.model.dataset import cached_features
from fragsearch.model.fragments import TextPipeline
from fragsearch.model.score import skl
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel

logger = logging.getLogger(__name__)

EMBED_CHUNK = 256  # training images embedded at a time


def teacher_paths(spec: str) -> list[Path]:
    """The checkpoints of `TrainConfig.distill_from`: one path, or several separated by commas."""
    paths = [Path(p.strip()) for p in spec.split(",") if p.strip()]
    if not paths:
        raise ValueError(f"distill_from {spec!r} names no checkpoint")
    return paths


@dataclass(frozen=True)
class _Part:
    """One checkpoint of a teacher: its model, blocks and the training images' fragments it embedded."""

    model: FragmentModel
    blocks: int
    images: torch.Tensor  # (N, F, h)


def _own_features(path: Path, cfg: ImageConfig, images: Sequence[Path], cache_root: Path | None,
                  device: str) -> torch.Tensor:
    """The training images' features as checkpoint `path` reads them (`cfg`), from the feature cache."""
    if cache_root is None or not images:
        raise ValueError(f"teacher {path} reads other image features than the student ({cfg}); give the training "
                         "images and the feature cache to read its own")
    feats, _ = cached_features(cache_root, cfg, images, device=device, what=f"features of teacher {path}")
    out = torch.from_numpy(feats)
    return out[:, :1].contiguous() if cfg.full_frame_only else out


class Teacher:
    """The batch scores of trained fragment models (checkpoints `paths`, summed) for the training images,
    on `device`: `feats` (N, F, D) as the student reads them (`image`); a checkpoint that reads other
    features gets its own for the same `images` (paths, in `feats`' order) from the cache at `cache_root`."""

    def __init__(self, paths: Path | Sequence[Path], text: TextPipeline, image: ImageConfig, feats: torch.Tensor,
                 device: str, *, images: Sequence[Path] = (), cache_root: Path | None = None) -> None:
        self.parts: list[_Part] = []
        by_cfg: dict[ImageConfig, torch.Tensor] = {image: feats}  # each feature set read once
        for path in [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]:
            bundle = Checkpoint.load(path, device=device)
            model = bundle.model
            if not isinstance(model, FragmentModel):
                raise ValueError(f"teacher {path}: a {type(model).__name__}, not a fragment model")
            if model.text_layers is not None:
                raise ValueError(f"teacher {path} reads words through its own MiniLM layers: a teacher reads the "
                                 "student's frozen vectors")
            if bundle.text.words.words != text.words.words or bundle.text.relations.kept != text.relations.kept:
                raise ValueError(f"teacher {path} was trained on other words or relations than the student's "
                                 "(train both on the same split)")
            if bundle.image_cfg not in by_cfg:
                by_cfg[bundle.image_cfg] = _own_features(path, bundle.image_cfg, images, cache_root, device)
            own = by_cfg[bundle.image_cfg]
            if len(own) != len(feats):
                raise ValueError(f"teacher {path}: {len(own)} training images, the student has {len(feats)}")
            model = model.eval()
            with torch.inference_mode():
                embedded = torch.cat([model.embed_images(own[s : s + EMBED_CHUNK].to(device))
                                      for s in range(0, len(own), EMBED_CHUNK)])
            self.parts.append(_Part(model, bundle.blocks, embedded))
            logger.info("teacher %s: h = %d in %d blocks, %d training images embedded%s", path, embedded.shape[-1],
                        bundle.blocks, len(embedded), "" if own is feats else " (its own features)")
        if not self.parts:
            raise ValueError("a teacher needs at least one checkpoint")

    def scores(self, imgs: np.ndarray, pool: torch.Tensor, rel: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """S_kl (K, L) of the training images `imgs` against the batch's sentences (padded triplets), summed
        over the teacher's checkpoints."""
        with torch.inference_mode():
            total: torch.Tensor | None = None
            for part in self.parts:
                img = part.images[torch.from_numpy(imgs).to(part.images.device)]
                sent = part.model.embed_sentences(pool, rel, a, b, mask)
                s = skl(img, torch.ones(img.shape[:2], device=img.device), sent, mask, blocks=part.blocks,
                        pool=part.model.pool())  # a teacher pooled over ranks scores as it was trained
                total = s if total is None else total + s
            assert total is not None
            return total.clone()
