"""The two fragment encoders of Deep Fragment Embeddings, and the global baselines: the two-branch
embedding, the DT-RNN / SDT-RNN and DeViSE.

- image fragment:    v = W_m . cnn + b_m
- sentence fragment: s = ReLU(W_R [We w1 ; We w2] + b_R), one (W_R, b_R) per kept relation,
  We fixed (rows of a frozen word-vector pool).

Options beyond the paper (each off by default): a hidden layer for every image fragment
(`image_hidden`); a hidden layer for the two global fragments only, the whole image and the whole
sentence (`global_hidden`: their encoders become the two-branch model's MLP branches while the
regions and triplets keep the paper's encoders); dropout on the frozen inputs while training
(`input_dropout`); MiniLM's last `text_layers` layers as the model's own, trained with the fragment objective
(model/textlayers.py: the words in context and the sentence vector then come from one pass of the caption's
words through MiniLM cut below them and these layers). None of them changes how fragments are scored.

The global models embed one vector per image and per sentence: a fragment model's special case of
one fragment per side (model/bundle.py scores them with the same S_kl).

- DT-RNN / SDT-RNN (SPEC.md §2, Socher et al. Eq. 4): h_i = tanh((W_v x_i + sum_j l(j) W_pos(i,j) h_j) / l(i))
  over the dependency tree (model/trees.py), one W per relative child position (l1, l2, ..., r1, ...;
  identity past the positions seen in training, as the paper does) or, for the SDT-RNN, per relation;
  the sentence vector is the root's; v = W_I z for the whole-image CNN vector z. No biases (the paper has none).
- DeViSE: v = M z into the word-vector space; a sentence is the mean of its words' fixed vectors,
  L2-normalised; nothing on the text side is trained.

Here they are what the runtime runs: NumPy over the trained weights (`Encoders`, from the arrays of a
checkpoint or a release), inference only. Training optimises the same encoders as torch modules
(training/nets/encoders.py), whose state-dict names these arrays keep; tests/test_encoders.py holds the two
to the same numbers for every kind.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from fragsearch.model.textlayers import PREFIX, TextLayers, first_layer
from fragsearch.model.textlayers import shapes as textlayer_shapes
from fragsearch.model.trees import TreeBatch

GLOBAL_KINDS = ("two-branch", "dt-rnn", "sdt-rnn", "devise")
KINDS = ("fragment", *GLOBAL_KINDS)
BATCH_NORM_EPS = 1e-5  # torch's BatchNorm1d default
NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's default


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a model; saved with its weights."""

    kind: str = "fragment"  # "fragment", "two-branch", "dt-rnn", "sdt-rnn" or "devise"
    img_dim: int = 1280
    word_dim: int = 384
    h: int = 1000  # embedding size (paper: ~1000)
    n_relations: int = 1
    hidden: int = 2048  # two-branch hidden width
    image_hidden: int = 0  # fragment model: 0 = linear image encoder (paper); >0 = one hidden ReLU layer
    dropout: float = 0.5  # dropout after the hidden layer (two-branch; fragment model's global encoders)
    global_hidden: int = 0  # fragment model: >0 = the whole-image and whole-sentence fragments get one hidden layer
    sentence_relation: int = -1  # relation id of the whole-sentence fragment (-1: the model has none)
    input_dropout: float = 0.0  # fragment model: dropout on CNN features and word vectors while training
    tree_left: int = 0  # DT-RNN: left-child position matrices (the most left children a training node has)
    tree_right: int = 0  # DT-RNN: right-child position matrices
    blocks: int = 1  # fragment model merged from this many members (training/merge.py): h is their equal slices,
    # thresholded apart in S_kl (model/score.py); 1 = one model, the paper's S_kl
    pool_ranks: int = 0  # fragment model: >0 = S_kl pools each sentence fragment's scores over the image's
    # fragments (that many) with learned weights over their ranks (model/score.py); 0 = their mean (the paper)
    text_layers: int = 0  # fragment model: >0 = MiniLM's last that many layers are the model's own, trained with
    # the fragment objective (model/textlayers.py); 0 = MiniLM frozen, as the paper keeps We

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows divided by their L2 norm (at least NORMALIZE_EPS), as torch's F.normalize."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), NORMALIZE_EPS)


class Encoders:
    """A trained model's encoders in NumPy: weights by their state-dict names (float32 arrays), inference only.

    Every method takes and returns float32 arrays; shapes as in each docstring."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
        if cfg.kind not in KINDS:
            raise ValueError(f"unknown model kind {cfg.kind!r}: 'fragment' or one of {', '.join(GLOBAL_KINDS)}")
        self.cfg = cfg
        self.weights = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        self._check()
        if cfg.kind == "fragment":  # (n_relations, 2d, h) and (n_relations, h): one matrix per relation
            self._w_rel = [self.weights[f"w_rel.{r}"] for r in range(cfg.n_relations)]
            self._b_rel = [self.weights[f"b_rel.{r}"] for r in range(cfg.n_relations)]
        # the model's own top layers of MiniLM, which its words and sentences are read through (None: frozen)
        self.text_layers = (TextLayers.from_arrays(self.weights, cfg.text_layers)
                            if cfg.kind == "fragment" and cfg.text_layers > 0 else None)

    def _check(self) -> None:
        """ValueError when a weight the kind reads is missing or of the wrong shape."""
        cfg = self.cfg
        want: dict[str, tuple[int, ...]] = {}
        if cfg.kind == "fragment":
            for r in range(cfg.n_relations):
                want[f"w_rel.{r}"] = (2 * cfg.word_dim, cfg.h)
                want[f"b_rel.{r}"] = (cfg.h,)
            if cfg.pool_ranks > 0:
                want["pool_logits"] = (cfg.pool_ranks,)
            if cfg.text_layers > 0:
                first_layer(cfg.text_layers)  # ValueError past MiniLM's layers
                want.update({f"{PREFIX}.{i}.{name}": shape for i in range(cfg.text_layers)
                             for name, shape in textlayer_shapes(cfg.word_dim, 4 * cfg.word_dim).items()})
            if cfg.image_hidden <= 0:
                want["image.weight"] = (cfg.h, cfg.img_dim)
            else:
                want["image.0.weight"] = (cfg.image_hidden, cfg.img_dim)
                want["image.2.weight"] = (cfg.h, cfg.image_hidden)
        elif cfg.kind == "two-branch":
            want["image.0.weight"] = (cfg.hidden, cfg.img_dim)
            want["text.0.weight"] = (cfg.hidden, cfg.word_dim)
        elif cfg.kind in ("dt-rnn", "sdt-rnn"):
            want["image.weight"] = (cfg.h, cfg.img_dim)
            want["word.weight"] = (cfg.h, cfg.word_dim)
        else:
            want["image.weight"] = (cfg.word_dim, cfg.img_dim)
        for name, shape in want.items():
            got = self.weights.get(name)
            if got is None or tuple(got.shape) != shape:
                raise ValueError(f"the {cfg.kind} model's weight {name} is "
                                 f"{'missing' if got is None else f'of shape {tuple(got.shape)}'}, expected {shape}")

    def arrays(self) -> dict[str, np.ndarray]:
        """The weights by state-dict name (what a checkpoint or a release stores)."""
        return dict(self.weights)

    @property
    def pool(self) -> np.ndarray | None:
        """The S_kl's weights over an image's ranked fragment scores (softmax of `pool_logits`, model/score.py),
        None for the mean."""
        logits = self.weights.get("pool_logits")
        if logits is None:
            return None
        e = np.exp(logits - logits.max())
        return np.asarray(e / e.sum(), dtype=np.float32)

    # -- layers ------------------------------------------------------------------------------------
    def _linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """x @ W^T + b for the torch Linear `name` (W: (out, in); no bias where it has none)."""
        y = x @ self.weights[f"{name}.weight"].T
        bias = self.weights.get(f"{name}.bias")
        return y if bias is None else y + bias

    def _mlp(self, name: str, x: np.ndarray) -> np.ndarray:
        """Linear -> ReLU -> (Dropout) -> Linear: the layers `name`.0 and `name`.3."""
        return self._linear(f"{name}.3", _relu(self._linear(f"{name}.0", x)))

    def _batch_norm(self, name: str, x: np.ndarray) -> np.ndarray:
        """BatchNorm1d in eval mode: the running statistics, then the affine part."""
        w = self.weights
        return ((x - w[f"{name}.running_mean"]) / np.sqrt(w[f"{name}.running_var"] + BATCH_NORM_EPS)
                * w[f"{name}.weight"] + w[f"{name}.bias"])

    # -- images ------------------------------------------------------------------------------------
    def embed_images(self, feats: np.ndarray) -> np.ndarray:
        """Fragment model: feats (K, F, img_dim), row 0 the whole image -> image fragments (K, F, h).
        Global models: feats (K, img_dim) whole-image features -> (K, h)."""
        x = np.asarray(feats, dtype=np.float32)
        cfg = self.cfg
        if cfg.kind == "two-branch":
            return _unit(self._batch_norm("image.4", self._mlp("image", x)))
        if cfg.kind != "fragment":
            return self._linear("image", x)
        image = ((lambda z: self._linear("image", z)) if cfg.image_hidden <= 0 else
                 (lambda z: self._linear("image.2", _relu(self._linear("image.0", z)))))
        if cfg.global_hidden <= 0:
            return image(x)
        return np.concatenate([self._mlp("global_image", x[:, :1]), image(x[:, 1:])], axis=1)

    # -- sentences ---------------------------------------------------------------------------------
    def embed_fragments(self, pool: np.ndarray, rel: np.ndarray, a: np.ndarray, b: np.ndarray, mask: np.ndarray
                        ) -> np.ndarray:
        """Fragment model: sentence fragments (L, T, h) from padded triplets.

        pool: (P, word_dim) frozen vectors; rel, a, b, mask: (L, T) relation ids, pool rows of w1 and w2,
        and 1 for real fragments. Padding rows come out as zeros.

        Each distinct (relation, w1 row, w2 row) is computed once and copied to every fragment that has it:
        a BLAS product's last bits depend on where a row falls in the matrix, and copies of one triplet
        must embed to the same vector (index/shared.py holds identical sentence fragments once)."""
        cfg = self.cfg
        n_sent, t = rel.shape
        real = np.flatnonzero(np.asarray(mask).reshape(-1) > 0)
        ia, ib = a.reshape(-1)[real], b.reshape(-1)[real]
        r = rel.reshape(-1)[real]
        out = np.zeros((n_sent * t, cfg.h), np.float32)
        global_sentence = cfg.global_hidden > 0 and 0 <= cfg.sentence_relation < cfg.n_relations
        for rid in np.unique(r):
            rows = np.flatnonzero(r == rid)
            pairs, where = np.unique(ia[rows].astype(np.int64) * len(pool) + ib[rows], return_inverse=True)
            xs = np.concatenate([pool[pairs // len(pool)], pool[pairs % len(pool)]], axis=1)  # (distinct, 2d)
            if rid == cfg.sentence_relation and global_sentence:
                pre = self._mlp("global_sentence", xs)
            else:
                pre = xs @ self._w_rel[int(rid)] + self._b_rel[int(rid)]
            out[real[rows]] = _relu(pre)[where.reshape(-1)]
        return out.reshape(n_sent, t, cfg.h)

    def embed_text(self, vecs: np.ndarray) -> np.ndarray:
        """Two-branch: vecs (L, word_dim) sentence vectors -> (L, h) unit vectors."""
        return _unit(self._batch_norm("text.4", self._mlp("text", np.asarray(vecs, dtype=np.float32))))

    def embed_trees(self, pool: np.ndarray, batch: TreeBatch) -> np.ndarray:
        """DT-RNN / SDT-RNN: sentence vectors (L, h), the root of each tree, nodes computed height by height;
        DeViSE: (L, word_dim), the L2-normalised mean of each sentence's word vectors (pool: (P, word_dim)
        fixed word vectors that batch.rows point into; an empty sentence is 0)."""
        cfg = self.cfg
        rows = np.asarray(batch.rows)
        if cfg.kind == "devise":
            has = rows >= 0
            total = np.zeros((batch.n_sentences, pool.shape[1]), np.float32)
            np.add.at(total, np.asarray(batch.sent_of)[has], pool[rows[has]])
            return _unit(total)
        size = np.asarray(batch.size, dtype=np.float32)
        has = (rows >= 0)[:, None].astype(np.float32)
        wx = self._linear("word", pool[np.maximum(rows, 0)] * has)  # (N, h)
        hid = np.zeros_like(wx)
        child_w = self.weights["child"]  # (M, h, h)
        for level in batch.levels:
            acc = wx[level.nodes].copy()
            if len(level.child):
                msg = hid[level.child] * size[level.child, None]
                mats = self._matrix_ids(np.asarray(level.rel), np.asarray(level.pos))
                for m in np.unique(mats):
                    sel = np.flatnonzero(mats == m)
                    if m >= 0:
                        msg[sel] = msg[sel] @ child_w[int(m)].T
                np.add.at(acc, np.asarray(level.parent), msg)
            hid[level.nodes] = np.tanh(acc / size[level.nodes, None])
        hid = np.concatenate([hid, np.zeros((1, hid.shape[1]), np.float32)])  # row N: an empty sentence's vector
        root = np.asarray(batch.root)
        return hid[np.where(root >= 0, root, len(hid) - 1)]

    def _matrix_ids(self, rel: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The child matrix of each edge (E,): its relation (SDT-RNN) or its position: l1..l_L are 0..L-1,
        r1..r_R are L..L+R-1; -1 (identity) for a position past those."""
        if self.cfg.kind == "sdt-rnn":
            return rel
        left, right = self.cfg.tree_left, self.cfg.tree_right
        ids = np.where(pos < 0, -pos - 1, left + pos - 1)
        beyond = ((pos < 0) & (-pos > left)) | ((pos > 0) & (pos > right))
        return np.where(beyond, -1, ids)
