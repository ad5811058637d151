"""MiniLM's top layers as the trainer trains them: the torch twin of model/textlayers.py (the runtime's NumPy),
started from the package's weights of those layers."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fragsearch.model.minilm_files import HIDDEN
from fragsearch.model.textlayers import HEADS, LN_EPS, PARTS, first_layer

INNER = 4 * HIDDEN  # MiniLM's intermediate width


class TextLayer(nn.Module):
    """BERT's post-norm transformer layer (MiniLM's shape), its parts named as model/textlayers.py `PARTS`."""

    def __init__(self, width: int = HIDDEN, inner: int = INNER) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.ln1 = nn.LayerNorm(width, eps=LN_EPS)
        self.inter = nn.Linear(width, inner)
        self.out = nn.Linear(inner, width)
        self.ln2 = nn.LayerNorm(width, eps=LN_EPS)

    def forward(self, x: torch.Tensor, real: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (N, d): the batch's pieces packed (padding left out), `real` (B, T) bool: where they sit in the
        padded batch, `bias` (B, 1, 1, T): the attention logits' mask (padding: the dtype's minimum) -> (N, d).
        Only the attention reads the padded batch; every product of a piece alone runs on the pieces."""
        b, t = real.shape
        d = x.shape[-1]
        hd = d // HEADS

        def heads(z: torch.Tensor) -> torch.Tensor:
            padded = z.new_zeros(b, t, d)
            padded[real] = z
            return padded.view(b, t, HEADS, hd).transpose(1, 2)

        logits = heads(self.q(x)) @ heads(self.k(x)).transpose(-1, -2) / math.sqrt(hd) + bias
        ctx = (logits.softmax(dim=-1) @ heads(self.v(x))).transpose(1, 2).reshape(b, t, d)[real]
        y = self.ln1(self.o(ctx) + x)
        out: torch.Tensor = self.ln2(self.out(F.gelu(self.inter(y))) + y)
        return out


class TextLayers(nn.Module):
    """The last `n` layers of MiniLM: hidden states after layer 6 - n -> its last hidden states."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.first = first_layer(n)
        self.layers = nn.ModuleList(TextLayer() for _ in range(n))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) after layer `first`, mask (B, T) (1 for a piece) -> (B, T, d) after MiniLM's last layer
        (zeros at padding)."""
        real = mask > 0
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~real, torch.finfo(x.dtype).min)
        packed = x[real]
        for layer in self.layers:
            packed = layer(packed, real, bias[:, None, None, :])
        out = x.new_zeros(x.shape)
        out[real] = packed
        return out

    def load_minilm(self) -> TextLayers:
        """These layers with the package's weights of MiniLM's layers first .. 5 (trained from there)."""
        from fragsearch.training.nets.minilm import bert

        model: Any = bert()
        source = model.encoder.layer
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                state = source[self.first + i].state_dict()
                for ours, theirs in PARTS.items():
                    part = getattr(layer, ours)
                    part.weight.copy_(state[f"{theirs}.weight"])
                    part.bias.copy_(state[f"{theirs}.bias"])
        return self
