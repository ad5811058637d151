"""One epoch of each training loop: the fragment objective (the dense C_0, then MIL C_F, plus the
global C_G) over minibatches of sentences, the two-branch and the global sentence encoders, with
the learning-rate schedule, the optimizer and fragment dropout (training/train.py runs the epochs)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from fragsearch.model.atomic import cached_file
from fragsearch.model.config import TrainConfig
from fragsearch.model.dataset import SplitData
from fragsearch.model.device import fused_optimizer
from fragsearch.model.fragments import EncodedSentences, TextPipeline, pad_rows
from fragsearch.model.places import Places
from fragsearch.model.score import flatten, skl_from_flat
from fragsearch.model.trees import TreeBatch
from fragsearch.model.words import cut_hidden
from fragsearch.training.boxes import batch_labels
from fragsearch.training.distill import Teacher
from fragsearch.training.graphs import make_graphs
from fragsearch.training.nets.encoders import DeViSE, FragmentModel, TreeRNN, TwoBranch
from fragsearch.training.objectives import (
    contrastive_global_loss,
    distill_loss,
    fragment_loss,
    global_loss,
    two_branch_loss,
)


def lr_at(cfg: TrainConfig, epoch: int, base: float | None = None) -> float:
    """The learning rate of 0-based `epoch`: `base` (default cfg.lr) x 0.1 in the last `anneal_epochs`."""
    return (cfg.lr if base is None else base) * (0.1 if epoch >= cfg.epochs - cfg.anneal_epochs else 1.0)


def param_groups(cfg: TrainConfig, model: torch.nn.Module) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: the encoders at `lr`, a fragment model's own top layers of MiniLM
    (ModelConfig.text_layers) at `text_lr`; each group's `base_lr` is what the schedule scales (`lr_at`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # fixed layers (text_from): left out
    text = [p for n, p in named if n.startswith("text_layers.")]
    rest = [p for n, p in named if not n.startswith("text_layers.")]
    groups = [{"params": rest, "lr": cfg.lr, "base_lr": cfg.lr}]
    if text:
        groups.append({"params": text, "lr": cfg.text_lr, "base_lr": cfg.text_lr})
    return groups


def optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter] | list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Adam or SGD over `params` (parameters, or `param_groups`' groups)."""
    flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    fused = fused_optimizer(list(flat))
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}: 'adam' or 'sgd'")


def _cut_hidden(keys: list[tuple[str, ...]], first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`cut_hidden` after the export step of its graph (MiniLM's first `first` layers, in the default graph
    folder, where model/words.py reads it)."""
    make_graphs(None, Places(), [first])
    return cut_hidden(keys, first)


class TunedText:
    """The training sentences' words in context and sentence vectors through the model's own top layers of
    MiniLM (ModelConfig.text_layers), with gradients: what `encode_tuned` gives the runtime, from the same
    input, MiniLM's hidden states after its first `first` layers (computed once, kept in `cache`).

    A sentence's rows of the frozen encoding's extra rows (`TextPipeline.encode_parsed`) are one per token
    (`tokens[l]` of them), then its sentence row (`whole`); a batch's pool holds the same rows, from the layers,
    sentence after sentence, and `pool` points the batch's fragments into it."""

    def __init__(self, keys: list[tuple[str, ...]], tokens: np.ndarray, whole: bool, first: int, base: int,
                 shift: int, cache: Path, device: str) -> None:
        digest = hashlib.sha1(json.dumps([first, keys]).encode()).hexdigest()[:16]
        hidden, offsets, words = cached_file(
            cache / f"cut{first}-{digest}.npz", lambda: _cut_hidden(keys, first),
            lambda v, fh: np.savez(fh, hidden=v[0], offsets=v[1], words=v[2]), _read_cut)
        self.hidden = torch.from_numpy(hidden).to(device)
        self.offsets, self.words, self.pieces = offsets, words, np.diff(offsets)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.whole = whole
        n_rows = self.tokens + int(whole)
        self.start = np.concatenate([[0], np.cumsum(n_rows)[:-1]]).astype(np.int64)  # first row in enc.extra
        self.base, self.shift, self.device = base, shift, device

    def _t(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x).to(self.device)

    def pool(self, layers: torch.nn.Module, sent: np.ndarray, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pool of the batch's sentences `sent` through `layers`, and their padded fragments' rows a, b
        (rows of the frozen pool, the unigram form's included: FragmentBatches) pointed into it."""
        lens = self.pieces[sent]
        steps = np.arange(int(lens.max()))
        real = steps[None, :] < lens[:, None]  # (B, T)
        at = np.where(real, self.offsets[sent][:, None] + steps[None, :], 0)
        real_t = self._t(real)
        x = self.hidden[self._t(at)] * real_t[..., None].to(self.hidden.dtype)
        out = layers(x, real_t.long())[real_t]  # (N, d): the batch's pieces, sentence after sentence
        tokens = self.tokens[sent]
        n_rows = tokens + int(self.whole)
        first_row = np.concatenate([[0], np.cumsum(n_rows)[:-1]]).astype(np.int64)  # in the batch's pool
        of_piece = np.repeat(np.arange(len(sent)), lens)
        word = self.words[at[real]]
        targets, sources = [], []
        kept = np.flatnonzero((word >= 0) & (word < tokens[of_piece]))  # a word's pieces: its row
        targets.append(first_row[of_piece[kept]] + word[kept])
        sources.append(out[self._t(kept)])
        if self.whole:  # every piece, [CLS] and [SEP] included: the sentence row
            targets.append(first_row[of_piece] + tokens[of_piece])
            sources.append(out)
        target = self._t(np.concatenate(targets))
        total = int(n_rows.sum())
        sums = out.new_zeros(total, out.shape[1]).index_add(0, target, torch.cat(sources))
        counts = torch.bincount(target, minlength=total).clamp_min(1).to(out.dtype)
        pool = F.normalize(sums / counts[:, None], dim=-1)
        start, first = self._t(self.start[sent])[:, None], self._t(first_row)[:, None]

        def point(rows: torch.Tensor) -> torch.Tensor:
            r = rows - self.base
            r = torch.where(r >= self.shift, r - self.shift, r)  # the unigram form's rows: the same layout
            return torch.where(mask > 0, first + r - start, torch.zeros_like(r))

        return pool, point(a), point(b)


def _read_cut(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with np.load(path) as z:
        return z["hidden"], z["offsets"], z["words"]


class FragmentBatches:
    """Training sentences as ids in one pool, with their unigram form for the fallback's share."""

    def __init__(self, text: TextPipeline, data: SplitData, unigram_prob: float, device: str,
                 tuned_from: int | None = None, cache: Path | None = None) -> None:
        """`tuned_from`: the model trains MiniLM's layers from that one on (`TunedText`, its input kept in
        `cache`); the frozen pool stays what a teacher reads."""
        if tuned_from is not None and text.cfg.word_vectors != "contextual":
            raise ValueError("a model that trains MiniLM's top layers reads words in context: word_vectors "
                             "'contextual'")
        enc = text.encode_parsed(data.parsed, data.sentences)
        self.enc = enc
        self.uni: EncodedSentences | None = None
        extras = [enc.extra]
        if unigram_prob > 0:
            uni = text.encode_parsed(data.parsed, data.sentences, unigram=True)
            base, shift = len(text.words), len(enc.extra)
            uni.a = [np.where(x >= base, x + shift, x) for x in uni.a]
            uni.b = [np.where(x >= base, x + shift, x) for x in uni.b]
            self.uni = uni
            extras.append(uni.extra)
        self.pool = torch.from_numpy(np.concatenate([text.words.vectors, *extras])).float().to(device)
        self.unigram_prob = unigram_prob
        self.labels: list[np.ndarray | None] | None = None  # box supervision's, per sentence (training/boxes.py)
        self.device = device
        self.tuned: TunedText | None = None
        if tuned_from is not None:
            if cache is None:
                raise ValueError("a model that trains MiniLM's top layers needs a cache folder for their input")
            self.tuned = TunedText([tuple(p.tokens) or ("",) for p in data.parsed],
                                   np.array([len(p.tokens) for p in data.parsed], dtype=np.int64),
                                   text.cfg.sentence_fragment, tuned_from, len(text.words), len(enc.extra), cache,
                                   device)

    def sentences(self, idx: np.ndarray, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
        return self.draw(idx, rng)[0]

    def draw(self, idx: np.ndarray, rng: np.random.Generator) -> tuple[tuple[torch.Tensor, ...], np.ndarray]:
        """The sentences `idx` as padded (rel, a, b, mask), and which were drawn in their unigram form."""
        use_uni = rng.random(len(idx)) < self.unigram_prob if self.uni is not None else np.zeros(len(idx), bool)
        srcs = [self.uni if u and self.uni is not None else self.enc for u in use_uni]
        return pad_rows([s.rel[i] for s, i in zip(srcs, idx, strict=True)],
                        [s.a[i] for s, i in zip(srcs, idx, strict=True)],
                        [s.b[i] for s, i in zip(srcs, idx, strict=True)], self.device), use_uni

    def box_labels(self, idx: np.ndarray, local: torch.Tensor, n_images: int, n_fragments: int,
                   sent_mask: torch.Tensor, img_mask: torch.Tensor, unigram: np.ndarray) -> torch.Tensor | None:
        """The batch's box labels (training/boxes.py) over its real fragment pairs, as `flatten` keeps them
        (I, J); None without box supervision or where the batch has none."""
        if self.labels is None:
            return None
        dense = batch_labels(self.labels, idx, local.cpu().numpy(), n_images, n_fragments, int(sent_mask.shape[1]),
                             unigram)
        if dense is None:
            return None
        y = torch.from_numpy(dense).to(sent_mask.device)
        return y[img_mask.reshape(-1) > 0][:, sent_mask.reshape(-1) > 0]


def batch_images(pair_image: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Unique images of a batch, the local image index of each sentence, and pos (K, L)."""
    imgs, local = np.unique(pair_image[idx], return_inverse=True)
    local_t = torch.from_numpy(local.astype(np.int64))
    pos = local_t[None, :] == torch.arange(len(imgs))[:, None]
    return imgs, local_t, pos


def global_top_k_at(cfg: TrainConfig, epoch: int) -> int:
    """The negatives C_G counts in 0-based `epoch`: 1 (the hardest) from `max_violation_from` on, else
    `global_top_k`."""
    return 1 if 0 < cfg.max_violation_from <= epoch + 1 else cfg.global_top_k


def drop_fragments(mask: torch.Tensor, p: float, rng: np.random.Generator) -> torch.Tensor:
    """`mask` (items, fragments; 1 = real) with each real fragment left out with probability `p`; an item
    whose every fragment would go keeps one of them, drawn at random."""
    real = mask > 0
    keep = torch.from_numpy(rng.random(tuple(mask.shape)) >= p).to(mask.device) & real
    lost = real.any(dim=1) & ~keep.any(dim=1)
    if bool(lost.any()):
        draw = torch.from_numpy(rng.random(tuple(mask.shape))).to(mask.device).masked_fill(~real, -1.0)
        rows = torch.nonzero(lost).flatten()
        keep[rows, draw[rows].argmax(dim=1)] = True
    return keep.to(mask.dtype)


def _step(opt: torch.optim.Optimizer, loss: torch.Tensor, clip: float = 0.0) -> float:
    """One optimiser step on `loss`, its gradient's global norm first clipped to `clip` when > 0;
    returns the loss."""
    opt.zero_grad()
    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], clip)
    opt.step()
    return float(loss.detach())


class ImageFeatures(Protocol):
    """What a training epoch reads image features from: (N, F, D) indexed by a tensor of image ids (a
    tensor of cached features, or features computed with gradients, training/finetune.py)."""

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor: ...


class MirroredViews:
    """Image features where each image of a batch is its mirrored view (ImageConfig.mirror) with
    probability `p`, drawn anew at every read: `ImageFeatures` over two (N, F, D) tensors of one shape."""

    def __init__(self, feats: torch.Tensor, mirrored: torch.Tensor, p: float, rng: np.random.Generator) -> None:
        if feats.shape != mirrored.shape:
            raise ValueError(f"mirrored view {tuple(mirrored.shape)} for features {tuple(feats.shape)}")
        self.feats, self.mirrored, self.p, self.rng = feats, mirrored, p, rng

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        flip = torch.from_numpy(self.rng.random(len(idx)) < self.p)
        return torch.where(flip[:, None, None], self.mirrored[idx], self.feats[idx])


def train_fragment_epoch(model: FragmentModel, cfg: TrainConfig, feats: ImageFeatures, data: SplitData,
                         batches: FragmentBatches, opt: torch.optim.Optimizer, epoch: int,
                         rng: np.random.Generator, order: np.ndarray | None = None,
                         teacher: Teacher | None = None) -> float:
    """One pass over the sentences ``order`` (default: all, shuffled) in batches of ``batch_size``; with a
    `teacher`, its batch scores are soft targets too (``distill_weight``)."""
    model.train()
    order = rng.permutation(len(data.sentences)) if order is None else order
    total, n = 0.0, 0
    mil = cfg.objective == "full" and epoch >= cfg.dense_epochs
    use_frag = cfg.objective in ("full", "fragment+global", "fragment")
    use_glob = cfg.objective in ("full", "fragment+global", "global")
    top_k = global_top_k_at(cfg, epoch)
    bar = tqdm(range(0, len(order), cfg.batch_size), desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False)
    for start in bar:
        idx = order[start : start + cfg.batch_size]
        imgs, local, pos = batch_images(data.pair_image, idx)
        local, pos = local.to(cfg.device), pos.to(cfg.device)
        img = model.embed_images(feats[torch.from_numpy(imgs)].to(cfg.device))
        img_mask = torch.ones(img.shape[:2], device=img.device)
        (rel, a, b, mask), unigram = batches.draw(idx, rng)
        if batches.tuned is not None and model.text_layers is not None:  # words through the model's own layers
            pool, sa, sb = batches.tuned.pool(model.text_layers, idx, a, b, mask)
            sent = model.embed_sentences(pool, rel, sa, sb, mask)
        else:
            sent = model.embed_sentences(batches.pool, rel, a, b, mask)
        soft = teacher.scores(imgs, batches.pool, rel, a, b, mask) if teacher is not None else None
        if cfg.fragment_drop > 0:
            img_mask = drop_fragments(img_mask, cfg.fragment_drop, rng)
            mask = drop_fragments(mask, cfg.fragment_drop, rng)
        flat = flatten(img, img_mask, sent, mask)  # pairwise fragment scores, shared by both objectives
        loss = img.new_zeros(())
        if use_frag:
            boxes = batches.box_labels(idx, local, len(imgs), img.shape[1], mask, img_mask, unigram)
            loss = loss + fragment_loss(flat, pos, mil=mil, balanced=cfg.balanced, boxes=boxes)
        if use_glob or soft is not None:
            scores = skl_from_flat(flat, pool=model.pool())
            if use_glob:
                loss = loss + cfg.beta * (contrastive_global_loss(scores, pos, local, cfg.nce_scale)
                                          if cfg.nce_scale > 0 else global_loss(scores, pos, local, cfg.margin, top_k))
            if soft is not None:
                loss = loss + cfg.distill_weight * distill_loss(scores, soft, cfg.distill_scale)
        total += _step(opt, loss, cfg.grad_clip)
        n += 1
        bar.set_postfix(loss=f"{total / n:.4f}")
    return total / max(n, 1)


def train_two_branch_epoch(model: TwoBranch, cfg: TrainConfig, feats: torch.Tensor, data: SplitData,
                           sent_vecs: torch.Tensor, opt: torch.optim.Optimizer, epoch: int,
                           rng: np.random.Generator) -> float:
    """Batches of images, each with two of its sentences (so structure triplets exist)."""
    model.train()
    n_img = feats.shape[0]
    by_image = [np.flatnonzero(data.pair_image == k) for k in range(n_img)]
    order = rng.permutation(n_img)
    total, n = 0.0, 0
    for start in tqdm(range(0, n_img, cfg.batch_size), desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False):
        imgs = order[start : start + cfg.batch_size]
        if len(imgs) < 2:
            continue
        sents = np.concatenate([rng.choice(by_image[k], size=min(2, len(by_image[k])), replace=False)
                                for k in imgs])
        pair_local = torch.from_numpy(np.searchsorted(np.sort(imgs), data.pair_image[sents])).to(cfg.device)
        sorted_imgs = np.sort(imgs)
        pos = pair_local[None, :] == torch.arange(len(imgs), device=cfg.device)[:, None]
        img = model.embed_images(feats[torch.from_numpy(sorted_imgs), 0].to(cfg.device))
        txt = model.embed_text(sent_vecs[torch.from_numpy(sents)].to(cfg.device))
        loss = two_branch_loss(img, txt, pos, pair_local, cfg.tb_margin, cfg.tb_top_k,
                               cfg.tb_lambda_img, cfg.tb_lambda_struct)
        total += _step(opt, loss, cfg.grad_clip)
        n += 1
    return total / max(n, 1)


def train_global_epoch(model: TreeRNN | DeViSE, cfg: TrainConfig, feats: torch.Tensor, data: SplitData,
                       enc: EncodedSentences, pool: torch.Tensor, opt: torch.optim.Optimizer, epoch: int,
                       rng: np.random.Generator) -> float:
    """One epoch of a tree RNN (bidirectional ranking, Socher et al. Eq. 5) or DeViSE (its hinge rank loss:
    `rank_images` False) over the inner products v . s of a batch's whole images and sentences."""
    model.train()
    assert enc.trees is not None
    order = rng.permutation(len(data.sentences))
    total, n = 0.0, 0
    bar = tqdm(range(0, len(order), cfg.batch_size), desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False)
    for start in bar:
        idx = order[start : start + cfg.batch_size]
        imgs, local, pos = batch_images(data.pair_image, idx)
        img = model.embed_images(feats[torch.from_numpy(imgs), 0].to(cfg.device))  # (K, h)
        sent = model.embed_sentences(pool, TreeBatch.of([enc.trees[i] for i in idx], cfg.device))  # (L, h)
        ones_i, ones_s = img.new_ones(len(img), 1), sent.new_ones(len(sent), 1)
        scores = flatten(img[:, None], ones_i, sent[:, None], ones_s).scores  # (K, L) v . s
        loss = global_loss(scores, pos.to(cfg.device), local.to(cfg.device), cfg.margin, cfg.global_top_k,
                           rank_images=cfg.rank_images)
        total += _step(opt, loss, cfg.grad_clip)
        n += 1
        bar.set_postfix(loss=f"{total / n:.4f}")
    return total / max(n, 1)
