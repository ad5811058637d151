"""MiniLM's top transformer layers as a model trains them (``ModelConfig.text_layers``): their weights.

A model with ``text_layers = n`` trains a copy of MiniLM's last n layers with the fragment objective: its
words in context and its sentence vector are read from MiniLM's first 6 - n layers (the package's weights)
followed by these layers with the model's own weights, stored with the model's encoders as
``text_layers.layers.<i>.<part>.weight|bias``. Only those layers are shipped; the rest of MiniLM stays the
package's. The runtime runs MiniLM's own graph with these weights in place of the package's for those layers
(model/minilm.py ``MiniLM(layers=...)``: ONNX Runtime, at MiniLM's own cost); the trainer runs its torch twin
(training/nets/textlayers.py) after MiniLM's graph cut below them. The two agree to float32 rounding
(tests/test_textlayers.py).

A layer is BERT's post-norm transformer layer as MiniLM has it (12 heads of 32, exact GELU, LayerNorm eps 1e-12):
    y = LN1(x + O(attention(Q x, K x, V x)));  out = LN2(y + OUT(gelu(INTER y)))
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

LAYERS = 6  # MiniLM-L6's transformer layers
HEADS = 12
LN_EPS = 1e-12
PREFIX = "text_layers.layers"  # the encoder arrays' names of the layers: <PREFIX>.<i>.<part>
# a layer's parts: our name -> MiniLM's (transformers' BertLayer) name in the package's weight file
PARTS = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
         "o": "attention.output.dense", "ln1": "attention.output.LayerNorm", "inter": "intermediate.dense",
         "out": "output.dense", "ln2": "output.LayerNorm"}


def shapes(width: int, inner: int) -> dict[str, tuple[int, ...]]:
    """Each part's weight and bias shape (torch's Linear: weight (out, in))."""
    out: dict[str, tuple[int, ...]] = {}
    for part in PARTS:
        w = {"inter": (inner, width), "out": (width, inner)}.get(part, (width, width))
        out[f"{part}.weight"] = (width,) if part.startswith("ln") else w
        out[f"{part}.bias"] = (w[0],) if not part.startswith("ln") else (width,)
    return out


def first_layer(n: int) -> int:
    """The index of MiniLM's first trained layer when its last `n` are trained (ValueError outside 1..6)."""
    if not 1 <= n <= LAYERS:
        raise ValueError(f"text_layers must be between 1 and {LAYERS} (MiniLM's layers), not {n}")
    return LAYERS - n


class TextLayers:
    """The trained layers of a model, MiniLM's layers `first` .. 5 (their weights; `graph_weights` names them as
    MiniLM's graph does).

    ``weights[i]``: layer first + i's parts by `PARTS` name (``q.weight``, ...), float32."""

    def __init__(self, first: int, weights: list[dict[str, np.ndarray]]) -> None:
        if first + len(weights) != LAYERS or not weights:
            raise ValueError(f"{len(weights)} trained layers from layer {first} do not end at MiniLM's {LAYERS}")
        width = int(weights[0]["q.weight"].shape[0])
        inner = int(weights[0]["inter.weight"].shape[0])
        want = shapes(width, inner)
        for i, layer in enumerate(weights):
            for name, shape in want.items():
                got = layer.get(name)
                if got is None or tuple(got.shape) != shape:
                    found = "missing" if got is None else f"of shape {tuple(got.shape)}"
                    raise ValueError(f"text layer {first + i}'s {name} is {found}, expected {shape}")
        self.first = first
        # copies: the vectors these layers give are keyed by `digest`, so the weights never change under it
        self.weights = [{k: np.array(v, dtype=np.float32, order="C") for k, v in layer.items()} for layer in weights]
        self._digest: str | None = None

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], n: int) -> TextLayers:
        """The `n` layers of a model's encoder arrays (``<PREFIX>.<i>.<part>...``)."""
        layers = [{k[len(f"{PREFIX}.{i}."):]: v for k, v in arrays.items() if k.startswith(f"{PREFIX}.{i}.")}
                  for i in range(n)]
        return cls(first_layer(n), layers)

    @property
    def digest(self) -> str:
        """sha256 (first 16 hex digits) of the layers' weights: what the vectors they give are keyed by."""
        if self._digest is None:
            h = hashlib.sha256(str(self.first).encode())
            for layer in self.weights:
                for name in sorted(layer):
                    h.update(name.encode())
                    h.update(layer[name].tobytes())
            self._digest = h.hexdigest()[:16]
        return self._digest

    def graph_weights(self) -> dict[str, np.ndarray]:
        """These layers' weights by the names MiniLM's graph gives the package's weights of those layers
        (``encoder.layer.<first + i>.<MiniLM's part>.weight|bias``, the same layout)."""
        return {f"encoder.layer.{self.first + i}.{PARTS[name.split('.')[0]]}.{name.split('.')[1]}": array
                for i, layer in enumerate(self.weights) for name, array in layer.items()}
