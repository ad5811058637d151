"""The trainer's checkpoint (``model.pt``): a model's torch modules with its text pipeline, image settings,
calibration and record of weight files; what training, merging, distillation and fine-tuning read and write.

A checkpoint loads without any training code and never unpickles code: the file is read with
``torch.load(weights_only=True)`` (tensors, numbers, strings, lists and dicts only), on the CPU, and the
modules are then moved to the device. What the runtime serves is the same model in NumPy: `Checkpoint.bundle`
(model/bundle.py's Bundle over the modules' current weights), `read_parts` (a .pt in the runtime's names, for
`Bundle.load`) and `Bundle.save` (the runtime's form, a release's).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fragsearch.model.atomic import atomic_file
from fragsearch.model.bundle import Bundle, check_weights, weight_record
from fragsearch.model.calibration import Calibration
from fragsearch.model.config import ImageConfig, TextConfig
from fragsearch.model.device import torch_device
from fragsearch.model.encoders import Encoders, ModelConfig
from fragsearch.model.fragments import EncodedSentences, TextPipeline
from fragsearch.model.modelfile import FORMAT, MODEL_JSON, CheckpointError, read_parts
from fragsearch.model.release import ReleaseError, check_release
from fragsearch.model.text import RelationVocab
from fragsearch.model.textlayers import TextLayers
from fragsearch.model.words import WordTable
from fragsearch.training.nets.encoders import FragmentModel, GlobalModel, arrays, build_model, load_arrays


class Checkpoint:
    """A model being trained or read for training: its torch modules (`model`) and what embeds with them.

    Embedding and scoring go through the runtime (`bundle`), so that evaluation, calibration and the
    service compute the same numbers from the same weights."""

    def __init__(self, model: FragmentModel | GlobalModel, text: TextPipeline, image_cfg: ImageConfig,
                 meta: dict[str, Any] | None = None, calibration: Calibration | None = None) -> None:
        self.model = model
        self._text = text
        self.image_cfg = image_cfg
        self.meta = dict(meta or {})
        self.calibration = calibration  # fragment models only: per-item score scales (NumPy)
        # name -> sha256 of the weight files the model was trained with (weight_files); None: record the
        # installed ones at the first save (a model trained in this process)
        self.weights: dict[str, str] | None = None

    @property
    def text(self) -> TextPipeline:
        """The text pipeline, reading words and sentences through the modules' trained top layers of MiniLM as
        they are now, where the model has them: every encoding (evaluation, calibration, the relevance fit) sees
        the current weights, never MiniLM's own or an earlier epoch's (the pipeline drops its kept vectors
        when the layers change)."""
        if isinstance(self.model, FragmentModel) and self.model.text_layers is not None:
            self._text.use_layers(TextLayers.from_arrays(arrays(self.model), self.cfg.text_layers))
        return self._text

    @property
    def device(self) -> torch.device:
        """Where the modules' weights are (training runs there)."""
        return next(self.model.parameters()).device

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def dim(self) -> int:
        return self.model.cfg.h

    @property
    def pool(self) -> np.ndarray | None:
        """`Bundle.pool` of the current weights."""
        pool = self.model.pool() if isinstance(self.model, FragmentModel) else None
        return None if pool is None else pool.detach().cpu().numpy().astype(np.float32)

    @property
    def blocks(self) -> int:
        return self.model.cfg.blocks

    @property
    def is_global(self) -> bool:
        return not isinstance(self.model, FragmentModel)

    @property
    def relevance(self) -> Any:
        return None if self.calibration is None else self.calibration.relevance

    def bundle(self) -> Bundle:
        """The runtime's Bundle over the modules' weights as they are now (views of them on the CPU)."""
        device = "cuda" if self.device.type == "cuda" else "cpu"
        # the pipeline itself: the Bundle sets its layers from the same weights (`text` would read them twice)
        bundle = Bundle(Encoders(self.cfg, arrays(self.model)), self._text, self.image_cfg, self.meta,
                        self.calibration, self.weights, device)
        return bundle

    def embed_images(self, feats: Any, calibrated: bool = True) -> np.ndarray:
        """`Bundle.embed_images` with the current weights."""
        return self.bundle().embed_images(np.asarray(feats), calibrated)

    def embed_sentences(self, enc: EncodedSentences, idx: list[int] | None = None, calibrated: bool = True
                        ) -> tuple[np.ndarray, np.ndarray]:
        """`Bundle.embed_sentences` with the current weights."""
        return self.bundle().embed_sentences(enc, idx, calibrated)

    def scores(self, img: Any, img_mask: Any, sent: Any, sent_mask: Any, chunk: int | None = None,
               blocks: int | None = None) -> np.ndarray:
        return self.bundle().scores(img, img_mask, sent, sent_mask, chunk, blocks)

    # -- persistence -------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Atomic write of the .pt (model/atomic.py)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        cal = None
        if self.calibration is not None:
            cal = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.calibration.to_arrays().items()}
            cal.update(self.calibration.settings())
        weights = self.weights if self.weights is not None else weight_record(self.text.cfg, self.image_cfg.backbone)
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
            "calibration": cal,
            "weights": weights,
        }
        self.weights = weights
        with atomic_file(path) as f:
            torch.save(state, f)

    @classmethod
    def load(cls, path: Path, device: str | torch.device = "cpu") -> Checkpoint:
        """A .pt, or a model in the runtime's form (its arrays become the modules' weights), on `device`
        (auto / cpu / cuda). CheckpointError as `Bundle.load`."""
        path = Path(path)
        path = path / MODEL_JSON if path.is_dir() else path
        if not path.is_file():
            raise CheckpointError(f"model checkpoint not found: {path}")
        try:
            check_release(path)
        except ReleaseError as exc:
            raise CheckpointError(str(exc)) from exc
        state, parts = read_parts(path)
        try:
            model_cfg = ModelConfig(**state["model_cfg"])
            model = build_model(model_cfg)
            load_arrays(model, {k[4:]: v for k, v in parts.items() if k.startswith("enc/")})
            words = list(state["words"])
            vectors = parts.get("word_vectors", np.zeros((len(words), model_cfg.word_dim), np.float32))
            text = TextPipeline(TextConfig(**state["text_cfg"]), RelationVocab.from_dict(state["relations"]),
                                WordTable(words, vectors))
            image_cfg = ImageConfig(**state["image_cfg"])
            cal_state = state.get("calibration")
            calibration = None if cal_state is None else Calibration.from_arrays(
                {k[4:]: v for k, v in parts.items() if k.startswith("cal/")}, cal_state)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise CheckpointError(f"{path}: a damaged or incompatible fragsearch checkpoint: {exc}") from exc
        weights = state.get("weights")
        if weights is not None:
            check_weights(path, weights, text.cfg, image_cfg.backbone)
        dev = torch_device(device)
        model.to(dev).eval()
        text.device = str(dev)
        ckpt = cls(model, text, image_cfg, state.get("meta", {}), calibration)
        ckpt.weights = weights
        return ckpt
