"""One epoch of each training loop: the fragment objective (the dense C_0, then MIL C_F, plus the
global C_G) over minibatches of sentences, the two-branch and the global sentence encoders, with
the learning-rate schedule, the optimizer and fragment dropout (training/train.py runs the epochs)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm

from model.config import TrainConfig
from model.dataset import SplitData
from model.device import fused_optimizer
from model.fragments import EncodedSentences, TextPipeline, pad_rows
from model.nets.encoders import DeViSE, FragmentModel, TreeRNN, TwoBranch
from model.score import flatten, skl_from_flat
from model.trees import TreeBatch
from training.distill import Teacher
from training.objectives import contrastive_global_loss, distill_loss, fragment_loss, global_loss, two_branch_loss


def lr_at(cfg: TrainConfig, epoch: int) -> float:
    return cfg.lr * (0.1 if epoch >= cfg.epochs - cfg.anneal_epochs else 1.0)


def optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    fused = fused_optimizer(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}: 'adam' or 'sgd'")


class FragmentBatches:
    """Training sentences as ids in one pool, with their unigram form for the fallback's share."""

    def __init__(self, text: TextPipeline, data: SplitData, unigram_prob: float, device: str) -> None:
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
        self.device = device

    def sentences(self, idx: np.ndarray, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
        use_uni = rng.random(len(idx)) < self.unigram_prob if self.uni is not None else np.zeros(len(idx), bool)
        srcs = [self.uni if u and self.uni is not None else self.enc for u in use_uni]
        return pad_rows([s.rel[i] for s, i in zip(srcs, idx, strict=True)],
                        [s.a[i] for s, i in zip(srcs, idx, strict=True)],
                        [s.b[i] for s, i in zip(srcs, idx, strict=True)], self.device)


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
        rel, a, b, mask = batches.sentences(idx, rng)
        sent = model.embed_sentences(batches.pool, rel, a, b, mask)
        soft = teacher.scores(imgs, batches.pool, rel, a, b, mask) if teacher is not None else None
        if cfg.fragment_drop > 0:
            img_mask = drop_fragments(img_mask, cfg.fragment_drop, rng)
            mask = drop_fragments(mask, cfg.fragment_drop, rng)
        flat = flatten(img, img_mask, sent, mask)  # pairwise fragment scores, shared by both objectives
        loss = img.new_zeros(())
        if use_frag:
            loss = loss + fragment_loss(flat, pos, mil=mil, balanced=cfg.balanced)
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
