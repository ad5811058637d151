"""A trained fragment model as a teacher: its S_kl over each training batch as soft targets.

The teacher is usually a merged ensemble (training/merge.py: members side by side, each thresholded
apart), the student a model of the served size trained by the same recipe. Per batch the teacher
scores the batch's images against its sentences with the one S_kl (model.score.skl, its own blocks),
and `training.objectives.distill_loss` pulls the student's batch scores towards the teacher's
ranking, in both directions, beside the fragment and global objectives (`TrainConfig.distill_weight`).

The teacher must read what the student reads: the same image features (ImageConfig) and the same
words and relations (its checkpoint's word table and relation vocabulary); ValueError otherwise. Its
image fragments are embedded once for every training image (no dropout: the teacher is evaluated);
its sentence fragments per batch, from the batch's own triplets. Raw S_kl: the teacher's
calibration is left out (it scales each item against reference fragments, a cost per batch that
would buy the soft targets nothing: they are standardised within each batch).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from model.bundle import Bundle
from model.config import ImageConfig
from model.encoders import FragmentModel
from model.fragments import TextPipeline
from model.score import skl

logger = logging.getLogger(__name__)

EMBED_CHUNK = 256  # training images embedded at a time


class Teacher:
    """The batch scores of a trained fragment model (its checkpoint at `path`) for the training images
    `feats` (N, F, D), on `device`."""

    def __init__(self, path: Path, text: TextPipeline, image: ImageConfig, feats: torch.Tensor,
                 device: str) -> None:
        bundle = Bundle.load(Path(path), device=device)
        model = bundle.model
        if not isinstance(model, FragmentModel):
            raise ValueError(f"teacher {path}: a {type(model).__name__}, not a fragment model")
        if bundle.image_cfg != image:
            raise ValueError(f"teacher {path} reads other image features than the student: {bundle.image_cfg} "
                             f"against {image}")
        if bundle.text.words.words != text.words.words or bundle.text.relations.kept != text.relations.kept:
            raise ValueError(f"teacher {path} was trained on other words or relations than the student's "
                             "(train both on the same split)")
        self.path = Path(path)
        self.model = model.eval()
        self.blocks = bundle.blocks
        self.device = device
        with torch.inference_mode():
            self.images = torch.cat([model.embed_images(feats[s : s + EMBED_CHUNK].to(device))
                                     for s in range(0, len(feats), EMBED_CHUNK)])
        logger.info("teacher %s: h = %d in %d blocks, %d training images embedded", path, self.images.shape[-1],
                    self.blocks, len(self.images))

    def scores(self, imgs: np.ndarray, pool: torch.Tensor, rel: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """S_kl (K, L) of the training images `imgs` against the batch's sentences (padded triplets)."""
        with torch.inference_mode():
            img = self.images[torch.from_numpy(imgs).to(self.images.device)]
            sent = self.model.embed_sentences(pool, rel, a, b, mask)
            return skl(img, torch.ones(img.shape[:2], device=img.device), sent, mask, blocks=self.blocks).clone()
