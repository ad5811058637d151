"""A model's files: the runtime's form (a folder of model.json + model.npz, read with NumPy) and the trainer's
checkpoint (model.pt, read with torch where it is installed), both read into the same two parts: a
description (the settings, relations, vocabulary, meta, calibration settings, weight record) and arrays by
the runtime's names (enc/<state-dict name>, word_vectors, cal/<name>). model/bundle.py builds the runtime's
Bundle from them; training/nets/checkpoint.py the trainer's Checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "fragsearch-checkpoint-1"  # the trainer's .pt (training/nets/checkpoint.py)
MODEL_FORMAT = "fragsearch-model-1"  # the runtime's folder: model.json + model.npz
MODEL_JSON = "model.json"
MODEL_ARRAYS = "model.npz"


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or of another format, or a weight file it depends on changed."""


def model_file(path: Path) -> Path:
    """The file a model path names: a folder of the runtime's form is its model.json."""
    path = Path(path)
    return path / MODEL_JSON if path.is_dir() else path


def read_parts(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The description and arrays of a model file: model.json (with its model.npz) or a .pt."""
    return read_model(path) if Path(path).suffix == ".json" else read_checkpoint(path)


def read_model(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """model.json and the model.npz beside it: (description, arrays); CheckpointError when either is
    missing, damaged, of another format, or the arrays are not the ones the description names."""
    try:
        state = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"{path} is not a fragsearch model (format {MODEL_FORMAT})")
    npz = Path(path).parent / MODEL_ARRAYS
    try:
        data = npz.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: its arrays {npz} cannot be read: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != state.get("arrays_sha256"):
        raise CheckpointError(f"{npz}: sha256 {digest[:16]}… where {path} records "
                              f"{str(state.get('arrays_sha256'))[:16]}… (a damaged or mixed copy)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{npz}: not readable arrays: {exc}") from exc
    return state, arrays



def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A trainer's checkpoint (.pt) as (description, arrays) in the runtime's names. It is read with
    ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists and dicts only: no code is unpickled), on
    the CPU. CheckpointError for a missing, damaged or foreign file, and, where torch is not installed, saying
    how to serve it."""
    try:
        import torch
    except ImportError as exc:
        raise CheckpointError(
            f"{path} is a trainer's checkpoint (.pt), which only the trainer's environment (torch) reads: make a "
            f"release of it there (python -m fragsearch.training.release --model {path} --out DIR) and serve DIR"
        ) from exc

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged file or a pickled object
        raise CheckpointError(f"cannot read model checkpoint {path} (tensors, numbers, strings, lists "
                              f"and dicts only): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                              ) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a fragsearch checkpoint (format {FORMAT})")
    try:
        out = {f"enc/{k}": v.detach().float().numpy() for k, v in state["state_dict"].items()
               if v.is_floating_point()}
        out["word_vectors"] = state["word_vectors"].float().numpy()
        description = {k: state[k] for k in ("model_cfg", "text_cfg", "image_cfg", "relations", "words")}
        description.update(meta=state.get("meta", {}), weights=state.get("weights"), calibration=None)
        cal = state.get("calibration")
        if cal is not None:
            for key in ("ref_images", "ref_sentence_rows", "ref_sentence_mask", "ref_sentences", "ref_image_scales",
                        "ref_sentence_scales"):
                if key in cal:
                    t = cal[key]
                    out[f"cal/{key}"] = t.numpy() if t.dtype == torch.bool else t.float().numpy()
            description["calibration"] = {k: cal[k] for k in ("floor_image", "floor_sentence", "local_k",
                                                               "local_power", "relevance") if k in cal}
    except (KeyError, AttributeError, TypeError) as exc:
        raise CheckpointError(f"{path}: a damaged or incompatible fragsearch checkpoint: {exc}") from exc
    return description, out
