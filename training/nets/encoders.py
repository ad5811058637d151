"""The fragment encoders and the global baselines as torch modules: what training optimises. The runtime
embeds with the same weights in NumPy (model/encoders.py `Encoders`, from `arrays`); tests/test_encoders.py
holds the two to the same numbers for every kind.

The model itself (the formulas, the options, the global baselines) is described in model/encoders.py.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fragsearch.model.device import host_masks
from fragsearch.model.encoders import GLOBAL_KINDS, ModelConfig
from fragsearch.model.trees import TreeBatch
from fragsearch.training.nets.textlayers import TextLayers


class FragmentModel(nn.Module):
    """Image fragment encoder (linear, or with one hidden layer) and per-relation sentence fragment encoder."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.image: nn.Module = (
            nn.Linear(cfg.img_dim, cfg.h) if cfg.image_hidden <= 0 else
            nn.Sequential(nn.Linear(cfg.img_dim, cfg.image_hidden), nn.ReLU(), nn.Linear(cfg.image_hidden, cfg.h)))
        scale = (2 * cfg.word_dim) ** -0.5
        # one (W_R, b_R) per relation, as separate tensors so a batch only touches the ones it uses
        self.w_rel = nn.ParameterList(
            [nn.Parameter(torch.randn(2 * cfg.word_dim, cfg.h) * scale) for _ in range(cfg.n_relations)])
        self.b_rel = nn.ParameterList([nn.Parameter(torch.zeros(cfg.h)) for _ in range(cfg.n_relations)])
        self.drop = InputDropout(cfg.input_dropout)
        self.global_image: nn.Module | None = None
        self.global_sentence: nn.Module | None = None
        # S_kl's weights over the ranks of an image's fragment scores: zeros = equal weights, the mean's S_kl
        self.pool_logits = nn.Parameter(torch.zeros(cfg.pool_ranks)) if cfg.pool_ranks > 0 else None
        # MiniLM's last `text_layers` layers as the model's own (trained from MiniLM's weights: load_minilm)
        self.text_layers = TextLayers(cfg.text_layers) if cfg.text_layers > 0 else None
        if cfg.global_hidden > 0:
            self.global_image = _mlp(cfg.img_dim, cfg.global_hidden, cfg.h, cfg.dropout)
            if 0 <= cfg.sentence_relation < cfg.n_relations:
                self.global_sentence = _mlp(2 * cfg.word_dim, cfg.global_hidden, cfg.h, cfg.dropout)

    def pool(self) -> torch.Tensor | None:
        """S_kl's weights over ranks (model/score.py; the runtime's `Encoders.pool`), None for the mean."""
        return None if self.pool_logits is None else torch.softmax(self.pool_logits, dim=0)

    def embed_images(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: (K, F, img_dim), row 0 the whole image -> image fragments (K, F, h)."""
        x = self.drop(feats)
        if self.global_image is None:
            return self.image(x)
        return torch.cat([self.global_image(x[:, :1]), self.image(x[:, 1:])], dim=1)

    def embed_sentences(
        self, pool: torch.Tensor, rel: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Sentence fragments (L, T, h) from padded triplets.

        pool: (P, word_dim) frozen vectors; rel, a, b, mask: (L, T) relation ids, pool rows of
        w1 and w2, and 1 for real fragments. Padding rows come out as zeros.
        """
        n_sent, t = rel.shape
        flat_mask = mask.reshape(-1).bool()
        x = self.drop(torch.cat([pool[a.reshape(-1)], pool[b.reshape(-1)]], dim=1)[flat_mask])  # (N, 2d)
        r = rel.reshape(-1)[flat_mask]
        order = torch.argsort(r, stable=True)
        rids, counts = torch.unique_consecutive(r[order], return_counts=True)
        parts = [self._relation(rid, xs)
                 for rid, xs in zip(rids.tolist(), torch.split(x[order], counts.tolist()), strict=True)]
        out = torch.cat(parts) if parts else x.new_zeros(0, self.cfg.h)
        out = out[torch.argsort(order)]  # back to fragment order
        full = x.new_zeros(n_sent * t, self.cfg.h)
        full[flat_mask] = F.relu(out)
        return full.reshape(n_sent, t, self.cfg.h)

    def _relation(self, rid: int, x: torch.Tensor) -> torch.Tensor:
        """Pre-activation of the fragments of one relation type. x: (N, 2d) -> (N, h)."""
        if rid == self.cfg.sentence_relation and self.global_sentence is not None:
            return self.global_sentence(x)
        return x @ self.w_rel[rid] + self.b_rel[rid]


class InputDropout(nn.Module):
    """nn.Dropout's rule while training (each element zeroed with probability p, the others scaled by
    1 / (1 - p); nothing at evaluation) with the mask of a CPU tensor drawn by NumPy
    (`fragsearch.model.device.host_masks`); its generator is seeded from torch's at the first draw, so a run
    seeded with torch.manual_seed draws the same masks again."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), not {p}")
        self.p = p
        self._rng: np.random.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if not host_masks(x.device):
            return F.dropout(x, self.p, training=True)
        if self._rng is None:
            self._rng = np.random.default_rng(int(torch.randint(0, 2**62, ()).item()))
        keep = torch.from_numpy(self._rng.random(tuple(x.shape), dtype=np.float32) >= self.p)
        return (x * keep).mul_(1.0 / (1.0 - self.p))


def _mlp(d_in: int, hidden: int, d_out: int, dropout: float) -> nn.Sequential:
    """Linear -> ReLU -> Dropout -> Linear."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, d_out))


class TwoBranch(nn.Module):
    """Two-branch structure-preserving embedding over one global vector per side.

    Each side: Linear -> ReLU -> Dropout -> Linear -> BatchNorm -> L2-normalise.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg

        def branch(d_in: int) -> nn.Sequential:
            return nn.Sequential(*_mlp(d_in, cfg.hidden, cfg.h, cfg.dropout), nn.BatchNorm1d(cfg.h))

        self.image = branch(cfg.img_dim)
        self.text = branch(cfg.word_dim)

    def embed_images(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: (K, img_dim) whole-image features -> (K, h) unit vectors."""
        return F.normalize(self.image(feats), dim=-1)

    def embed_text(self, vecs: torch.Tensor) -> torch.Tensor:
        """vecs: (L, word_dim) sentence vectors -> (L, h) unit vectors."""
        return F.normalize(self.text(vecs), dim=-1)


class TreeRNN(nn.Module):
    """DT-RNN (kind "dt-rnn": a matrix per child position) or SDT-RNN ("sdt-rnn": per relation)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.semantic = cfg.kind == "sdt-rnn"
        n_mats = cfg.n_relations if self.semantic else cfg.tree_left + cfg.tree_right
        self.image = nn.Linear(cfg.img_dim, cfg.h, bias=False)  # W_I
        self.word = nn.Linear(cfg.word_dim, cfg.h, bias=False)  # W_v
        self.child = nn.Parameter(torch.randn(max(n_mats, 1), cfg.h, cfg.h) * cfg.h**-0.5)  # W_pos / W_rel, (M, h, h)

    def embed_images(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: (K, img_dim) whole-image features -> (K, h)."""
        return self.image(feats)

    def matrix_ids(self, rel: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The child matrix of each edge (E,): its relation (SDT-RNN) or its position: l1..l_L are
        0..L-1, r1..r_R are L..L+R-1; -1 (identity) for a position past those."""
        if self.semantic:
            return rel
        left, right = self.cfg.tree_left, self.cfg.tree_right
        ids = torch.where(pos < 0, -pos - 1, left + pos - 1)
        beyond = ((pos < 0) & (-pos > left)) | ((pos > 0) & (pos > right))
        return torch.where(beyond, -1, ids)

    def _messages(self, h: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
        """W_m h for each row of h (E, h) with its matrix id (E,), grouped by matrix."""
        order = torch.argsort(mats, stable=True)
        ids, counts = torch.unique_consecutive(mats[order], return_counts=True)
        parts = [x if m < 0 else x @ self.child[m].T
                 for m, x in zip(ids.tolist(), torch.split(h[order], counts.tolist()), strict=True)]
        out = torch.cat(parts) if parts else h
        return out[torch.argsort(order)]

    def embed_sentences(self, pool: torch.Tensor, batch: TreeBatch) -> torch.Tensor:
        """Sentence vectors (L, h): the root of each tree, nodes computed height by height
        (pool: (P, word_dim) fixed word vectors that batch.rows point into). An empty sentence is 0."""
        has = (batch.rows >= 0).unsqueeze(1).to(pool.dtype)
        wx = self.word(pool[batch.rows.clamp_min(0)] * has)  # (N, h)
        hid = wx.new_zeros(wx.shape)
        for level in batch.levels:
            acc = wx[level.nodes]
            if len(level.child):
                msg = self._messages(hid[level.child] * batch.size[level.child, None],
                                     self.matrix_ids(level.rel, level.pos))
                acc = acc.index_add(0, level.parent, msg)
            hid = hid.index_copy(0, level.nodes, torch.tanh(acc / batch.size[level.nodes, None]))
        hid = torch.cat([hid, hid.new_zeros(1, hid.shape[1])])  # row N: the vector of an empty sentence
        return hid[torch.where(batch.root >= 0, batch.root, len(hid) - 1)]


class DeViSE(nn.Module):
    """DeViSE: the image mapped linearly into the word-vector space; a sentence = its mean word vector."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.h != cfg.word_dim:
            raise ValueError(f"DeViSE embeds in the word-vector space: h = {cfg.h} must be word_dim = {cfg.word_dim}")
        self.cfg = cfg
        self.image = nn.Linear(cfg.img_dim, cfg.word_dim, bias=False)  # M

    def embed_images(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: (K, img_dim) whole-image features -> (K, word_dim)."""
        return self.image(feats)

    def embed_sentences(self, pool: torch.Tensor, batch: TreeBatch) -> torch.Tensor:
        """(L, word_dim): the L2-normalised mean of each sentence's word vectors (words without one are
        left out; a sentence with none is 0)."""
        has = batch.rows >= 0
        x = pool[batch.rows[has]]
        total = x.new_zeros(batch.n_sentences, x.shape[1]).index_add(0, batch.sent_of[has], x)
        return F.normalize(total, dim=-1)


GlobalModel = TwoBranch | TreeRNN | DeViSE


def build_model(cfg: ModelConfig) -> FragmentModel | GlobalModel:
    if cfg.kind == "fragment":
        return FragmentModel(cfg)
    if cfg.kind == "two-branch":
        return TwoBranch(cfg)
    if cfg.kind in ("dt-rnn", "sdt-rnn"):
        return TreeRNN(cfg)
    if cfg.kind == "devise":
        return DeViSE(cfg)
    raise ValueError(f"unknown model kind {cfg.kind!r}: 'fragment' or one of {', '.join(GLOBAL_KINDS)}")


def arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The module's weights and buffers by state-dict name, as float32 NumPy arrays (the runtime's
    `Encoders` reads them; views of the tensors where they are float32 on the CPU)."""
    return {name: np.asarray(t.detach().cpu().float().numpy()) for name, t in model.state_dict().items()
            if t.is_floating_point()}


def load_arrays(model: nn.Module, weights: dict[str, np.ndarray]) -> nn.Module:
    """The module with the weights of `arrays` (strict: every parameter and buffer named)."""
    state = model.state_dict()
    missing = sorted(set(state) - set(weights) - {k for k, v in state.items() if not v.is_floating_point()})
    unknown = sorted(set(weights) - set(state))
    if missing or unknown:
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unknown {unknown[:5]}")
    model.load_state_dict({**state, **{k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in weights.items()}})
    return model
