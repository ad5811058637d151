"""Train a fragment model (or a global baseline: two-branch, DT-RNN, SDT-RNN, DeViSE) on a data folder's train split.

    python -m model.train --data ../shared/data/flickr8k --variant full --out artifacts/models/full

C = C_F + beta * C_G + alpha * ||theta||^2 with the paper's schedule: the first `dense_epochs`
with the dense fragment objective C_0, then its MIL form C_F; learning rate x0.1 for the last
`anneal_epochs`. The backbone is frozen (its features are cached). The checkpoint kept is the one
with the best dev R-sum (R@1+R@5+R@10, both directions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import resource
import shlex
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from model.bundle import Bundle
from model.calibrate import fit_calibration
from model.config import (
    ImageConfig,
    TextConfig,
    add_region_flags,
    default_artifacts_dir,
    default_data_dir,
    with_region_flags,
)
from model.dataset import SplitData, load_split_data
from model.device import device_name
from model.encoders import DeViSE, FragmentModel, ModelConfig, TreeRNN, TwoBranch, build_model
from model.evaluate import evaluate
from model.fragments import SENTENCE_REL, EncodedSentences, TextPipeline, pad_rows
from model.objectives import fragment_loss, global_loss, two_branch_loss
from model.score import flatten, skl_from_flat
from model.text import make_parser
from model.trees import TreeBatch, position_ranges

logger = logging.getLogger(__name__)

OBJECTIVES = ("full", "fragment+global", "fragment", "global")
# ModelConfig fields a variant or a CLI flag of the same name may set for a fragment model
MODEL_OPTIONS = {"image_hidden": int, "global_hidden": int, "dropout": float, "input_dropout": float}


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings (each is a CLI flag of the same name)."""

    objective: str = "full"  # full (C_0 -> C_F, + global), fragment+global (C_0 + global), fragment, global
    epochs: int = 10  # paper: 20 (half the budget fits a 2-core machine; dev R-sum has flattened by then)
    dense_epochs: int = 4  # epochs with the dense C_0 before switching to MIL C_F (paper: half)
    anneal_epochs: int = 2  # last epochs at lr x 0.1
    batch_size: int = 100  # image-sentence pairs per batch
    optimizer: str = "adam"  # "adam" or "sgd" (momentum 0.9, as in the paper)
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 1e-6  # alpha
    beta: float = 1.0  # weight of the global ranking objective
    margin: float = 0.05  # Delta of C_G (S_kl are averages, so it is on their small scale)
    global_top_k: int = 0  # C_G over the k most violating negatives per pair and direction (0 = all, paper)
    rank_images: bool = True  # DT-RNN / DeViSE: the ranking loss also ranks images for a sentence (False: DeViSE's)
    balanced: bool = True  # average positive and negative fragment hinges separately
    h: int = 256  # embedding size (paper: ~1000)
    calibrate: int = 0  # fragment models: reference images and sentences for score calibration (0 = none)
    # two-branch baseline
    tb_margin: float = 0.1
    tb_top_k: int = 50
    tb_lambda_img: float = 2.0
    tb_lambda_struct: float = 0.1
    eval_every: int = 2
    seed: int = 0
    device: str = "auto"  # auto (cuda when available) | cpu | cuda: model/device.py


# Named rows of docs/results: (model kind, text settings, image settings, train settings) overrides.
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "paper": {},
    "fragment+global": {"train": {"objective": "fragment+global"}},
    "fragment": {"train": {"objective": "fragment"}},
    "global": {"train": {"objective": "global"}},
    "fullframe": {"image": {"full_frame_only": True}},
    "bow": {"text": {"fragments": "bow"}},
    "bigram": {"text": {"fragments": "bigram"}},
    "sentence": {"text": {"sentence_fragment": True}},
    # only the whole-image row of the cache is read, the same at every region floor: share full-roi's
    "two-branch": {"model": {"kind": "two-branch", "h": 512}, "text": {"sentence_fragment": True},
                   "image": {"min_box_frac": 0.25},
                   "train": {"lr": 1e-3, "weight_decay": 1e-5, "epochs": 30, "batch_size": 128, "eval_every": 3}},
}
VARIANTS["large-regions"] = {"text": {"sentence_fragment": True}, "image": {"min_box_frac": 0.15},
                             "train": {"global_top_k": 5}}
VARIANTS["large-regions+mlp"] = {**VARIANTS["large-regions"], "model": {"image_hidden": 1024}}
VARIANTS["contextual"] = {**VARIANTS["large-regions"],
                          "text": {"sentence_fragment": True, "word_vectors": "contextual"}}
VARIANTS["contextual-r25"] = {**VARIANTS["contextual"], "image": {"min_box_frac": 0.25}}
VARIANTS["wide"] = {**VARIANTS["contextual-r25"], "model": {"h": 512}, "train": {"global_top_k": 5, "beta": 2.0}}
VARIANTS["dropout"] = {**VARIANTS["wide"], "model": {"h": 512, "input_dropout": 0.2}}
VARIANTS["full-roi"] = {**VARIANTS["dropout"], "train": {**VARIANTS["wide"]["train"], "calibrate": 1000}}
# region features from a CNN pass per region (R-CNN-style crops, float backbone)
VARIANTS["full-crop"] = {**VARIANTS["full-roi"],
                         "image": {**VARIANTS["full-roi"]["image"], "region_features": "crop"}}
# the served default: crops through the int8 backbone, proposals at 112 px, ranked by a 224 px pass
VARIANTS["full"] = {**VARIANTS["full-crop"],
                    "image": {**VARIANTS["full-crop"]["image"], "backbone_precision": "int8",
                              "proposal_resize": 112, "backbone_size": 224}}

# The seeds' global sentence encoders (SPEC.md §2; DeViSE) over the whole-image CNN vector, row 0 of
# `full`'s feature cache: trained on the inner products v . s with their papers' ranking losses, scored
# as S_kl of one fragment per side. Static word vectors as in the papers, and contextual ones.
VARIANTS["dt-rnn"] = {
    "model": {"kind": "dt-rnn", "h": 256}, "text": {"fragments": "tree"},
    "image": {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8",
              "proposal_resize": 112, "backbone_size": 224},
    "train": {"margin": 1.0}}
VARIANTS["sdt-rnn"] = {
    "model": {"kind": "sdt-rnn", "h": 256}, "text": {"fragments": "tree"},
    "image": {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8",
              "proposal_resize": 112, "backbone_size": 224},
    "train": {"margin": 1.0}}
VARIANTS["devise"] = {
    "model": {"kind": "devise", "h": 384}, "text": {"fragments": "tree"},
    "image": {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8",
              "proposal_resize": 112, "backbone_size": 224},
    "train": {"margin": 0.1, "rank_images": False}}
# DeViSE as the fragment paper re-implemented it: the same model, ranked both ways (its global objective)
VARIANTS["devise-bidirectional"] = {
    "model": {"kind": "devise", "h": 384}, "text": {"fragments": "tree"},
    "image": {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8",
              "proposal_resize": 112, "backbone_size": 224},
    "train": {"margin": 0.1}}
VARIANTS["dt-rnn-contextual"] = {
    "model": {"kind": "dt-rnn", "h": 256}, "text": {"fragments": "tree", "word_vectors": "contextual"},
    "image": {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8",
              "proposal_resize": 112, "backbone_size": 224},
    "train": {"margin": 1.0}}
VARIANTS["sdt-rnn-contextual"] = {
    "model": {"kind": "sdt-rnn", "h": 256}, "text": {"fragments": "tree", "word_vectors": "contextual"},
    "image": {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8",
              "proposal_resize": 112, "backbone_size": 224},
    "train": {"margin": 1.0}}
VARIANTS["devise-contextual"] = {
    "model": {"kind": "devise", "h": 384}, "text": {"fragments": "tree", "word_vectors": "contextual"},
    "image": {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8",
              "proposal_resize": 112, "backbone_size": 224},
    "train": {"margin": 0.1, "rank_images": False}}


@dataclass
class Run:
    variant: str
    train: TrainConfig
    text: TextConfig
    image: ImageConfig
    model_kind: str = "fragment"
    model_overrides: dict[str, Any] = field(default_factory=dict)


def make_run(variant: str, overrides: dict[str, Any], model_overrides: dict[str, Any] | None = None) -> Run:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    v = VARIANTS[variant]
    train = dataclasses.replace(TrainConfig(), **{**v.get("train", {}), **overrides})
    model = {**v.get("model", {}), **(model_overrides or {})}
    if "h" in model and "h" not in overrides:
        train = dataclasses.replace(train, h=model["h"])
    return Run(variant, train, TextConfig(**v.get("text", {})), ImageConfig(**v.get("image", {})),
               model.get("kind", "fragment"), model)


def _lr_at(cfg: TrainConfig, epoch: int) -> float:
    return cfg.lr * (0.1 if epoch >= cfg.epochs - cfg.anneal_epochs else 1.0)


def _optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
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


def _batch_images(pair_image: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Unique images of a batch, the local image index of each sentence, and pos (K, L)."""
    imgs, local = np.unique(pair_image[idx], return_inverse=True)
    local_t = torch.from_numpy(local.astype(np.int64))
    pos = local_t[None, :] == torch.arange(len(imgs))[:, None]
    return imgs, local_t, pos


def train_fragment_epoch(model: FragmentModel, run: Run, feats: torch.Tensor, data: SplitData,
                         batches: FragmentBatches, opt: torch.optim.Optimizer, epoch: int,
                         rng: np.random.Generator) -> float:
    cfg = run.train
    model.train()
    order = rng.permutation(len(data.sentences))
    total, n = 0.0, 0
    mil = cfg.objective == "full" and epoch >= cfg.dense_epochs
    use_frag = cfg.objective in ("full", "fragment+global", "fragment")
    use_glob = cfg.objective in ("full", "fragment+global", "global")
    bar = tqdm(range(0, len(order), cfg.batch_size), desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False)
    for start in bar:
        idx = order[start : start + cfg.batch_size]
        imgs, local, pos = _batch_images(data.pair_image, idx)
        local, pos = local.to(cfg.device), pos.to(cfg.device)
        img = model.embed_images(feats[torch.from_numpy(imgs)].to(cfg.device))
        img_mask = torch.ones(img.shape[:2], device=img.device)
        rel, a, b, mask = batches.sentences(idx, rng)
        sent = model.embed_sentences(batches.pool, rel, a, b, mask)
        flat = flatten(img, img_mask, sent, mask)  # pairwise fragment scores, shared by both objectives
        loss = img.new_zeros(())
        if use_frag:
            loss = loss + fragment_loss(flat, pos, mil=mil, balanced=cfg.balanced)
        if use_glob:
            loss = loss + cfg.beta * global_loss(skl_from_flat(flat), pos, local, cfg.margin, cfg.global_top_k)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += float(loss.detach())
        n += 1
        bar.set_postfix(loss=f"{total / n:.4f}")
    return total / max(n, 1)


def train_two_branch_epoch(model: TwoBranch, run: Run, feats: torch.Tensor, data: SplitData,
                           sent_vecs: torch.Tensor, opt: torch.optim.Optimizer, epoch: int,
                           rng: np.random.Generator) -> float:
    """Batches of images, each with two of its sentences (so structure triplets exist)."""
    cfg = run.train
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
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += float(loss.detach())
        n += 1
    return total / max(n, 1)


def train_global_epoch(model: TreeRNN | DeViSE, run: Run, feats: torch.Tensor, data: SplitData,
                       enc: EncodedSentences, pool: torch.Tensor, opt: torch.optim.Optimizer, epoch: int,
                       rng: np.random.Generator) -> float:
    """One epoch of a tree RNN (bidirectional ranking, Socher et al. Eq. 5) or DeViSE (its hinge rank loss:
    `rank_images` False) over the inner products v . s of a batch's whole images and sentences."""
    cfg = run.train
    model.train()
    assert enc.trees is not None
    order = rng.permutation(len(data.sentences))
    total, n = 0.0, 0
    bar = tqdm(range(0, len(order), cfg.batch_size), desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False)
    for start in bar:
        idx = order[start : start + cfg.batch_size]
        imgs, local, pos = _batch_images(data.pair_image, idx)
        img = model.embed_images(feats[torch.from_numpy(imgs), 0].to(cfg.device))  # (K, h)
        sent = model.embed_sentences(pool, TreeBatch.of([enc.trees[i] for i in idx], cfg.device))  # (L, h)
        ones_i, ones_s = img.new_ones(len(img), 1), sent.new_ones(len(sent), 1)
        scores = flatten(img[:, None], ones_i, sent[:, None], ones_s).scores  # (K, L) v . s
        loss = global_loss(scores, pos.to(cfg.device), local.to(cfg.device), cfg.margin, cfg.global_top_k,
                           rank_images=cfg.rank_images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += float(loss.detach())
        n += 1
        bar.set_postfix(loss=f"{total / n:.4f}")
    return total / max(n, 1)


def train(run: Run, train_data: SplitData, dev_data: SplitData | None, out: Path,
          cache_root: Path) -> dict[str, Any]:
    """Train, evaluate on dev every `eval_every` epochs, keep the best checkpoint as out/model.pt.

    Everything runs on run.train.device (resolved here: auto -> cuda when available)."""
    run.train = cfg = dataclasses.replace(run.train, device=device_name(run.train.device))
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    text = TextPipeline.fit(run.text, train_data.parsed, cache_root / "words")
    text.device = cfg.device
    for data in (train_data, dev_data):
        if data is not None:
            text.warm(data.parsed, data.sentences, cache_root / "vectors")
    sid = text.relations.index(SENTENCE_REL)
    shape = {k: v for k, v in run.model_overrides.items() if k in MODEL_OPTIONS}
    trees = text.encode_parsed(train_data.parsed, train_data.sentences) if run.text.fragments == "tree" else None
    if trees is not None and trees.trees is not None:
        shape["tree_left"], shape["tree_right"] = position_ranges(trees.trees)
    mcfg = ModelConfig(kind=run.model_kind, h=cfg.h, n_relations=len(text.relations),
                       img_dim=train_data.feats.shape[-1], word_dim=text.words.dim,
                       sentence_relation=-1 if sid is None else sid, **shape)
    model = build_model(mcfg).to(cfg.device)
    bundle = Bundle(model, text, run.image, meta={"variant": run.variant, "train": dataclasses.asdict(cfg)})
    feats = torch.from_numpy(train_data.feats)
    if run.image.full_frame_only:
        feats = feats[:, :1].contiguous()
    opt = _optimizer(cfg, list(model.parameters()))
    t0 = time.perf_counter()
    if isinstance(model, TwoBranch):
        enc = text.encode_parsed(train_data.parsed, train_data.sentences)
        sent_vecs = torch.from_numpy(enc.extra).float()  # one sentence fragment each, in order
        step = lambda e: train_two_branch_epoch(model, run, feats, train_data, sent_vecs, opt, e, rng)  # noqa: E731
    elif isinstance(model, TreeRNN | DeViSE):
        if trees is None:
            raise ValueError(f"a {run.model_kind} model composes sentences from their trees: text fragments 'tree'")
        pool = torch.from_numpy(np.concatenate([text.words.vectors, trees.extra])).float().to(cfg.device)
        global_model = model
        step = lambda e: train_global_epoch(global_model, run, feats, train_data, trees, pool, opt, e, rng)  # noqa: E731
    else:
        batches = FragmentBatches(text, train_data, run.text.unigram_prob, cfg.device)
        step = lambda e: train_fragment_epoch(model, run, feats, train_data, batches, opt, e, rng)  # noqa: E731
    logger.info("training %s on %s: %d images, %d sentences, %d relations, h=%d (prep %.1fs)", run.variant,
                cfg.device, len(train_data.names), len(train_data.sentences), len(text.relations), cfg.h,
                time.perf_counter() - t0)
    history: list[dict[str, float]] = []
    best: dict[str, float] | None = None
    out.mkdir(parents=True, exist_ok=True)
    for epoch in range(cfg.epochs):
        for g in opt.param_groups:
            g["lr"] = _lr_at(cfg, epoch)
        t_ep = time.perf_counter()
        loss = step(epoch)
        row: dict[str, float] = {"epoch": epoch + 1, "loss": loss, "seconds": time.perf_counter() - t_ep}
        last = epoch == cfg.epochs - 1
        evaluated = dev_data is not None and ((epoch + 1) % cfg.eval_every == 0 or last)
        if cfg.calibrate > 0 and isinstance(model, FragmentModel) and (evaluated or last):
            bundle.calibration = fit_calibration(bundle, train_data, cfg.calibrate, cfg.seed)
            bundle.meta["calibration"] = {"refs": cfg.calibrate, "split": "train", "seed": cfg.seed}
        if evaluated and dev_data is not None:
            m = evaluate(bundle, dev_data)
            row.update({k: m[k] for k in ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1",
                                          "search_r5", "search_r10", "annot_medr", "search_medr")})
            if best is None or m["rsum"] > best["rsum"]:
                best = {**m, "epoch": float(epoch + 1)}
                bundle.meta["dev"] = best
                bundle.save(out / "model.pt")
        elif dev_data is None and last:
            bundle.save(out / "model.pt")
        history.append(row)
        logger.info("epoch %d: %s", epoch + 1, json.dumps({k: round(v, 4) for k, v in row.items()}))
    summary = {"variant": run.variant, "best": best, "history": history,
               "train_seconds": time.perf_counter() - t0,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "config": {"train": dataclasses.asdict(cfg), "text": dataclasses.asdict(run.text),
                          "image": dataclasses.asdict(run.image), "model": mcfg.to_dict()}}
    (out / "history.json").write_text(json.dumps(summary, indent=2))
    return summary


def _add_config_flags(ap: argparse.ArgumentParser) -> None:
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=None)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            ap.add_argument(flag, type=typ, default=None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_dir())
    ap.add_argument("--variant", default="full", choices=sorted(VARIANTS))
    ap.add_argument("--out", type=Path, default=None, help="default: artifacts/models/<variant>")
    ap.add_argument("--cache", type=Path, default=default_artifacts_dir() / "cache")
    ap.add_argument("--train-split", default="train")
    ap.add_argument("--dev-split", default="dev", help="'' to train without dev evaluation")
    ap.add_argument("--train-limit", type=int, default=None, help="only the first N training images")
    ap.add_argument("--dev-limit", type=int, default=None)
    add_region_flags(ap, None)  # each defaults to the variant's
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
    _add_config_flags(ap)
    for name, typ in MODEL_OPTIONS.items():
        ap.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help="model shape (ModelConfig)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    shape = {k: getattr(args, k) for k in MODEL_OPTIONS if getattr(args, k) is not None}
    run = make_run(args.variant, overrides, shape)
    run.image = with_region_flags(run.image, args)
    out = args.out or default_artifacts_dir() / "models" / args.variant
    parser = make_parser(run.text.parser)
    device = device_name(run.train.device)
    tr = load_split_data(args.data, args.train_split, run.image, args.cache, parser, args.workers,
                         args.train_limit, device)
    dev = (load_split_data(args.data, args.dev_split, run.image, args.cache, parser, args.workers,
                           args.dev_limit, device) if args.dev_split else None)
    summary = train(run, tr, dev, out, args.cache)
    command = "python -m model.train " + shlex.join(sys.argv[1:] if argv is None else argv)
    summary["command"] = command
    (out / "history.json").write_text(json.dumps(summary, indent=2))
    logger.info("best dev: %s", json.dumps(summary["best"]))


if __name__ == "__main__":
    main()
