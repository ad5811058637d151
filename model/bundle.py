"""A trained model with everything it needs to embed new sentences and images: the checkpoint.

A checkpoint holds the weights, the model/text/image settings, the kept relations, the word
table and, where the model is calibrated, its reference fragments (model/calibration.py), so it loads
without any training code (`Bundle.load`).

Loading never unpickles code: the file is read with ``torch.load(weights_only=True)`` (tensors,
numbers, strings, lists and dicts only), on the CPU, and the model is then moved to the device
(model/device.py). A Bundle embeds and scores on its model's device and hands back CPU tensors,
so the index and the service handle only CPU arrays whatever the device.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.atomic import atomic_file
from model.calibration import Calibration, Relevance
from model.config import ImageConfig, TextConfig
from model.device import resolve_device
from model.encoders import DeViSE, FragmentModel, GlobalModel, ModelConfig, TreeRNN, TwoBranch, build_model
from model.fragments import SENTENCE_REL, EncodedSentences, TextPipeline, pad
from model.image import RegionExtractor
from model.score import skl
from model.text import RelationVocab
from model.trees import TreeBatch
from model.words import WordTable

logger = logging.getLogger(__name__)

FORMAT = "fragsearch-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or of another format."""


class Bundle:
    """Model + text pipeline + image settings: embeds and scores image and sentence fragments."""

    _calibration: Calibration | None

    def __init__(self, model: FragmentModel | GlobalModel, text: TextPipeline, image_cfg: ImageConfig,
                 meta: dict[str, Any] | None = None, calibration: Calibration | None = None) -> None:
        self.model = model
        self.text = text
        self.image_cfg = image_cfg
        self.meta = dict(meta or {})
        self.calibration = calibration  # fragment models only: per-item score scales
        self._extractor: RegionExtractor | None = None
        self._extractor_lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (embedding and scoring run there)."""
        return next(self.model.parameters()).device

    @property
    def calibration(self) -> Calibration | None:
        return self._calibration

    @calibration.setter
    def calibration(self, cal: Calibration | None) -> None:
        """Kept on the model's device (its references are scored against every new item)."""
        self._calibration = None if cal is None else cal.to(self.device)

    @property
    def relevance(self) -> Relevance | None:
        """The relevance scale of the calibrated score (None: an older checkpoint, or no calibration)."""
        return None if self._calibration is None else self._calibration.relevance

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def dim(self) -> int:
        return self.model.cfg.h

    @property
    def is_global(self) -> bool:
        """One vector per image and per sentence (two-branch, DT-RNN, SDT-RNN, DeViSE): the fragment
        model's special case of one fragment per side, the whole image and the whole sentence."""
        return not isinstance(self.model, FragmentModel)

    @property
    def extractor(self) -> RegionExtractor:
        """The region extractor of the model's image settings, on the model's device (made on first use)."""
        with self._extractor_lock:
            if self._extractor is None:
                self._extractor = RegionExtractor(self.image_cfg, str(self.device))
            return self._extractor

    def embed_images(self, feats: np.ndarray | torch.Tensor, calibrated: bool = True) -> torch.Tensor:
        """feats: (K, F, img_dim) cached region features -> image fragments (K, F', h).

        F' = 1 for a full-frame model and for the global models (their one whole-image vector).
        A calibrated model divides each image's fragments by its scale sigma_k (model/calibration.py).
        """
        x = torch.as_tensor(feats, dtype=torch.float32)
        if self.image_cfg.full_frame_only or self.is_global:
            x = x[:, :1]
        x = x.to(self.device)
        if not isinstance(self.model, FragmentModel):
            return self.model.embed_images(x[:, 0])[:, None, :].cpu()
        img = self.model.embed_images(x)
        if calibrated and self.calibration is not None:
            img = img / self.calibration.image_scales(img)[:, None, None]
        return img.cpu()

    def embed_sentences(self, enc: EncodedSentences, idx: list[int] | None = None, calibrated: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sentence fragments (L, T, h) and their mask (L, T) for encoded sentences (each sentence's
        fragments divided by its scale tau_l in a calibrated model). A global model gives (L, 1, h)."""
        if isinstance(self.model, TreeRNN | DeViSE):
            if enc.trees is None:
                raise ValueError("a tree or word-mean model needs sentences encoded with their trees")
            trees = enc.trees if idx is None else [enc.trees[i] for i in idx]
            batch = TreeBatch.of(trees)
            pool, rows, _ = self.text.pool_of(enc, batch.rows.clamp_min(0), batch.rows[:0])
            vecs = self.model.embed_sentences(pool.to(self.device), batch.with_rows(rows).to(self.device))
            return vecs[:, None, :].cpu(), torch.ones(len(trees), 1)
        rel, a, b, mask = pad(enc, idx)
        pool, a, b = self.text.pool_of(enc, a, b)
        rel, a, b, mask, pool = (t.to(self.device) for t in (rel, a, b, mask, pool))
        if isinstance(self.model, TwoBranch):
            sid = self.text.relations.index(SENTENCE_REL)
            if sid is None:
                raise ValueError("a two-branch model needs the whole-sentence fragment")
            last = torch.eq(rel, sid).float().argmax(dim=1)
            rows = a[torch.arange(a.shape[0], device=a.device), last]
            return self.model.embed_text(pool[rows])[:, None, :].cpu(), torch.ones(a.shape[0], 1)
        sent, m = self.model.embed_sentences(pool, rel, a, b, mask), mask.float()
        if calibrated and self.calibration is not None:
            sent = sent / self.calibration.sentence_scales(sent, m)[:, None, None]
        return sent.cpu(), m.cpu()

    def scores(self, img: torch.Tensor, img_mask: torch.Tensor, sent: torch.Tensor, sent_mask: torch.Tensor,
               chunk: int | None = None) -> torch.Tensor:
        """(K, L) image–sentence scores S_kl (model/score.py); for a global model, one fragment per side,
        S_kl = max(0, v . s) / (1 + n): its inner product wherever that is positive.

        Computed on the model's device, returned on the CPU."""
        dev = self.device
        img, img_mask, sent, sent_mask = (t.to(dev) for t in (img, img_mask, sent, sent_mask))
        return skl(img, img_mask, sent, sent_mask, chunk=chunk).cpu()

    # -- persistence -------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Atomic write (model/atomic.py)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "format": FORMAT,
            "model_cfg": self.model.cfg.to_dict(),
            "text_cfg": dataclasses.asdict(self.text.cfg),
            "image_cfg": dataclasses.asdict(self.image_cfg),
            "state_dict": {k: v.cpu() for k, v in self.model.state_dict().items()},
            "relations": self.text.relations.to_dict(),
            "words": list(self.text.words.words),
            "word_vectors": torch.from_numpy(np.asarray(self.text.words.vectors, dtype=np.float32)),
            "meta": self.meta,
            "calibration": None if self.calibration is None else self.calibration.to_state(),
        }
        with atomic_file(path) as f:
            torch.save(state, f)

    @classmethod
    def load(cls, path: Path, device: str | torch.device = "cpu") -> Bundle:
        """Read a checkpoint on the CPU without unpickling code, then move the model to `device`
        (auto / cpu / cuda: model/device.py). CheckpointError for a missing, damaged or foreign file."""
        path = Path(path)
        dev = resolve_device(device)
        if not path.is_file():
            raise CheckpointError(f"model checkpoint not found: {path}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a damaged file or a pickled object
            raise CheckpointError(f"cannot read model checkpoint {path} (tensors, numbers, strings, lists "
                                  f"and dicts only): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                                  ) from exc
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a fragsearch checkpoint (format {FORMAT})")
        try:
            model_cfg = ModelConfig(**state["model_cfg"])
            model = build_model(model_cfg)
            model.load_state_dict(state["state_dict"])
            words = WordTable(list(state["words"]), state["word_vectors"].numpy())
            text = TextPipeline(TextConfig(**state["text_cfg"]), RelationVocab.from_dict(state["relations"]), words)
            image_cfg = ImageConfig(**state["image_cfg"])
            cal = state.get("calibration")
            calibration = None if cal is None else Calibration.from_state(cal)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise CheckpointError(f"{path}: a damaged or incompatible fragsearch checkpoint: {exc}") from exc
        model.to(dev).eval()
        text.device = str(dev)
        return cls(model, text, image_cfg, state.get("meta", {}), calibration)
