"""Train a fragment model (or a global baseline: two-branch, DT-RNN, SDT-RNN, DeViSE) on a data folder's train split.

    python -m training.train --data ../shared/data/flickr8k --variant full --out artifacts/models/full
    python -m training.train --list        (the variants: model/variants/*.toml, model/variants.py)
    python -m training.train --list --resolved [--variant full]    (every field as resolved, as TOML)

C = C_F + beta * C_G + alpha * ||theta||^2 with the paper's schedule: the first `dense_epochs`
with the dense fragment objective C_0, then its MIL form C_F; learning rate x0.1 for the last
`anneal_epochs`. The backbone is frozen (its features are cached).

Model selection never looks at dev (the split the results table reports; bench/report.py evaluates
it): with `--selection val` (the default) `--val-images` training images, drawn once with
`--val-seed` and never trained on, are held out with their captions, and the checkpoint kept is the
epoch with the best R-sum (R@1+R@5+R@10, both directions) on them; with `--selection last` every
training image is trained on and the last epoch is kept (a fixed epoch count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import resource
import shlex
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from tqdm import tqdm

from model.bundle import Bundle
from model.config import (
    SELECTIONS,
    ImageConfig,
    TextConfig,
    TrainConfig,
    add_region_flags,
    default_artifacts_dir,
    default_data_dir,
    with_region_flags,
)
from model.dataset import SplitData, hold_out, load_split_data
from model.device import device_name
from model.encoders import DeViSE, FragmentModel, ModelConfig, TreeRNN, TwoBranch, build_model
from model.fragments import SENTENCE_REL, EncodedSentences, TextPipeline, pad_rows
from model.objectives import fragment_loss, global_loss, two_branch_loss
from model.score import flatten, skl_from_flat
from model.text import make_parser
from model.trees import TreeBatch, position_ranges
from model.variants import (
    MODEL_SHAPE,
    SECTIONS,
    VARIANTS_DIR,
    VariantError,
    field_meanings,
    load_variant,
    read_variant_file,
    variant_names,
)
from training.calibrate import fit_calibration, fit_relevance, store_relevance
from training.evaluate import evaluate_scores

logger = logging.getLogger(__name__)

OBJECTIVES = ("full", "fragment+global", "fragment", "global")
MODEL_OPTIONS = MODEL_SHAPE  # ModelConfig fields a variant or a CLI flag of the same name may set
VAL_METRICS = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10", "annot_medr",
               "search_medr")  # kept per evaluated epoch in the history, as val_<name>


@dataclass
class Run:
    variant: str
    train: TrainConfig
    text: TextConfig
    image: ImageConfig
    model_kind: str = "fragment"
    model_overrides: dict[str, Any] = field(default_factory=dict)


def make_run(variant: str, overrides: dict[str, Any], model_overrides: dict[str, Any] | None = None) -> Run:
    """The variant's settings (model/variants/<variant>.toml) with flag `overrides` of TrainConfig fields
    and `model_overrides` of model shape options."""
    v = load_variant(variant)
    model = {**v.model, **(model_overrides or {})}
    return Run(variant, dataclasses.replace(v.train, **overrides), v.text, v.image, v.model_kind, model)


def list_variants(out: TextIO) -> None:
    """One line per variant: its name, the variant it extends and what it sets, and its description."""
    for name in variant_names():
        v = load_variant(name)
        base, _, own = read_variant_file(VARIANTS_DIR / f"{name}.toml")
        sets = ", ".join(f"{s}.{k}={val}" for s in SECTIONS for k, val in own[s].items())
        out.write(f"{name:18s} {('= ' + base + ' + ') if base else '= defaults + '}{sets or 'nothing'}\n"
                  f"{'':18s}   {v.description}\n")


def _toml_value(value: Any) -> str:
    """A scalar setting as TOML (strings in JSON's escapes, which TOML's basic strings share)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def list_resolved(out: TextIO, names: list[str]) -> None:
    """Every field of each variant in `names` as resolved (`Variant.resolved`), as TOML: a table per
    variant (description, base) and one per settings group ([<name>.model], [<name>.text], ...)."""
    for name in names:
        v = load_variant(name)
        key = name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)
        out.write(f"[{key}]\ndescription = {json.dumps(v.description)}\n")
        if v.base is not None:
            out.write(f"base = {json.dumps(v.base)}\n")
        for section, values in v.resolved().items():
            out.write(f"\n[{key}.{section}]\n")
            out.writelines(f"{field_name} = {_toml_value(value)}\n" for field_name, value in values.items())
        out.write("\n")


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
    top_k = global_top_k_at(cfg, epoch)
    bar = tqdm(range(0, len(order), cfg.batch_size), desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False)
    for start in bar:
        idx = order[start : start + cfg.batch_size]
        imgs, local, pos = _batch_images(data.pair_image, idx)
        local, pos = local.to(cfg.device), pos.to(cfg.device)
        img = model.embed_images(feats[torch.from_numpy(imgs)].to(cfg.device))
        img_mask = torch.ones(img.shape[:2], device=img.device)
        rel, a, b, mask = batches.sentences(idx, rng)
        sent = model.embed_sentences(batches.pool, rel, a, b, mask)
        if cfg.fragment_drop > 0:
            img_mask = drop_fragments(img_mask, cfg.fragment_drop, rng)
            mask = drop_fragments(mask, cfg.fragment_drop, rng)
        flat = flatten(img, img_mask, sent, mask)  # pairwise fragment scores, shared by both objectives
        loss = img.new_zeros(())
        if use_frag:
            loss = loss + fragment_loss(flat, pos, mil=mil, balanced=cfg.balanced)
        if use_glob:
            loss = loss + cfg.beta * global_loss(skl_from_flat(flat), pos, local, cfg.margin, top_k)
        total += _step(opt, loss, run.train.grad_clip)
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
        total += _step(opt, loss, run.train.grad_clip)
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
        total += _step(opt, loss, run.train.grad_clip)
        n += 1
        bar.set_postfix(loss=f"{total / n:.4f}")
    return total / max(n, 1)


def train(run: Run, train_data: SplitData, val_data: SplitData | None, out: Path,
          cache_root: Path) -> dict[str, Any]:
    """Train; with `val_data` (a part held out of the training images, never dev: `hold_out`) evaluate
    on it every `eval_every` epochs and keep the best epoch as out/model.pt, without it keep the last.

    Everything runs on run.train.device (resolved here: auto -> cuda when available)."""
    run.train = cfg = dataclasses.replace(run.train, device=device_name(run.train.device))
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    text = TextPipeline.fit(run.text, train_data.parsed, cache_root / "words")
    text.device = cfg.device
    for data in (train_data, val_data):
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
    selection: dict[str, Any] = (
        {"rule": "last", "epochs": cfg.epochs} if val_data is None else
        {"rule": "val", "epochs": cfg.epochs, "images": len(val_data.names), "seed": cfg.val_seed})
    out.mkdir(parents=True, exist_ok=True)
    for epoch in range(cfg.epochs):
        for g in opt.param_groups:
            g["lr"] = _lr_at(cfg, epoch)
        t_ep = time.perf_counter()
        loss = step(epoch)
        row: dict[str, float] = {"epoch": epoch + 1, "loss": loss, "seconds": time.perf_counter() - t_ep}
        last = epoch == cfg.epochs - 1
        evaluated = val_data is not None and ((epoch + 1) % cfg.eval_every == 0 or last)
        if cfg.calibrate > 0 and isinstance(model, FragmentModel) and (evaluated or last):
            bundle.calibration = fit_calibration(bundle, train_data, cfg.calibrate, cfg.seed)
            bundle.meta["calibration"] = {"refs": cfg.calibrate, "split": "train", "seed": cfg.seed}
        if evaluated and val_data is not None:
            m, val_scores = evaluate_scores(bundle, val_data)
            if bundle.calibration is not None:  # the relevance scale of this epoch's calibrated score
                store_relevance(bundle, fit_relevance(val_scores, val_data.pair_image), len(val_data.names))
            row.update({f"val_{k}": m[k] for k in VAL_METRICS})
            if best is None or m["rsum"] > best["rsum"]:
                best = {**m, "epoch": float(epoch + 1)}
                bundle.meta["selection"] = {**selection, "epoch": epoch + 1, "val": best}
                bundle.save(out / "model.pt")
        elif val_data is None and last:
            bundle.meta["selection"] = {**selection, "epoch": epoch + 1}
            bundle.save(out / "model.pt")
        history.append(row)
        logger.info("epoch %d: %s", epoch + 1, json.dumps({k: round(v, 4) for k, v in row.items()}))
    selection["epoch"] = int(best["epoch"]) if best is not None else cfg.epochs
    summary = {"variant": run.variant, "selection": selection, "best": best, "history": history,
               "train_images": len(train_data.names), "train_sentences": len(train_data.sentences),
               "train_seconds": time.perf_counter() - t0,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "config": {"train": dataclasses.asdict(cfg), "text": dataclasses.asdict(run.text),
                          "image": dataclasses.asdict(run.image), "model": mcfg.to_dict()}}
    (out / "history.json").write_text(json.dumps(summary, indent=2))
    return summary


FLAG_HELP = {
    "selection": "which epoch is kept: val = the best R-sum on --val-images training images held out of training "
                 "(never dev); last = the last epoch, every training image trained on (a fixed epoch count)",
    "val_images": "training images (with their captions) held out as the validation part of --selection val",
    "val_seed": "seed of the draw of the validation part (fixed: the same images in every run)",
    "eval_every": "epochs between evaluations on the validation part (--selection val)",
}


def _add_config_flags(ap: argparse.ArgumentParser) -> None:
    meanings = field_meanings("train")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        say = FLAG_HELP.get(f.name) or meanings.get(f.name)
        if f.type in ("bool", bool):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=None,
                            help=f"{say} (true/false; default: the variant's)")
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            ap.add_argument(flag, type=typ, default=None, help=f"{say} (default: the variant's)",
                            choices=SELECTIONS if f.name == "selection" else None)


def split_for_selection(cfg: TrainConfig, data: SplitData) -> tuple[SplitData, SplitData | None]:
    """(what is trained on, the validation part or None): `cfg.val_images` training images held out
    with `cfg.val_seed` for --selection val, nothing for --selection last."""
    if cfg.selection == "last":
        return data, None
    if cfg.selection != "val":
        raise ValueError(f"unknown selection {cfg.selection!r}: one of {', '.join(SELECTIONS)}")
    if not 0 < cfg.val_images < len(data.names) // 2:
        raise ValueError(f"cannot hold out {cfg.val_images} of {len(data.names)} training images for validation "
                         "(at most half): pass a smaller --val-images, or --selection last")
    rest, val = hold_out(data, cfg.val_images, cfg.val_seed)
    logger.info("model selection on %d training images held out with their %d captions (seed %d); training on %d",
                len(val.names), len(val.sentences), cfg.val_seed, len(rest.names))
    return rest, val


@dataclass(frozen=True)
class Trained:
    """What a training run left in its folder: the checkpoint and the epoch kept (its history.json holds the
    rest: every epoch's loss and validation metrics, the resolved settings, the command that reproduces it)."""

    variant: str
    checkpoint: Path  # <out>/model.pt
    selection: str  # "val" or "last" (TrainConfig.selection)
    epoch: int  # the epoch kept
    epochs: int
    seconds: float  # training, features excluded


def train_on(run: Run, data: Path, out: Path, cache: Path, flags: list[str], *, split: str = "train",
             workers: int = 2, limit: int | None = None) -> Trained:
    """Train `run` on the `split` images of the data folder (the first `limit`; features extracted into
    `cache` where missing), keep the epoch its selection rule picks as out/model.pt, and write
    out/history.json with the command line `flags` of `python -m training.train` give."""
    device = device_name(run.train.device)
    images = load_split_data(data, split, run.image, cache, make_parser(run.text.parser), workers, limit, device)
    tr, val = split_for_selection(run.train, images)
    summary = train(run, tr, val, out, cache)
    summary["command"] = "python -m training.train " + shlex.join(flags)
    (out / "history.json").write_text(json.dumps(summary, indent=2))
    kept = summary["selection"]
    logger.info("kept epoch %d of %d (%s)", kept["epoch"], run.train.epochs, kept["rule"])
    return Trained(run.variant, out / "model.pt", kept["rule"], kept["epoch"], run.train.epochs,
                   summary["train_seconds"])


def train_variant(variant: str, data: Path, out: Path, selection: str, *, cache: Path, workers: int = 2,
                  device: str = "auto", limit: int | None = None) -> Trained:
    """Train the variant as its file gives it (model/variants/<variant>.toml) on the data folder's training
    split, keeping the epoch `selection` ("val" or "last") picks: what a first start calls when its model
    is missing (service/prepare.py). An unknown variant raises VariantError before any extraction."""
    run = make_run(variant, {"selection": selection, "device": device})
    flags = ["--data", str(data), "--variant", variant, "--out", str(out), "--cache", str(cache),
             "--workers", str(workers), "--device", device, "--selection", selection]
    if limit is not None:
        flags += ["--train-limit", str(limit)]
    return train_on(run, data, out, cache, flags, workers=workers, limit=limit)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the variants (model/variants/*.toml) and exit")
    ap.add_argument("--resolved", action="store_true",
                    help="print every field of every variant (of --variant when given) as resolved, as TOML, "
                         "and exit (python -m training.train --list --resolved)")
    ap.add_argument("--data", type=Path, default=default_data_dir(),
                    help="the Flickr8K folder (default: FRAGSEARCH_DATA or ../shared/data/flickr8k)")
    ap.add_argument("--variant", default=None, help="a model/variants/<name>.toml (--list); default: full")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: artifacts/models/<variant>")
    ap.add_argument("--cache", type=Path, default=default_artifacts_dir() / "cache",
                    help="the feature, parse and vector cache (git-ignored); default: artifacts/cache")
    ap.add_argument("--train-split", default="train", help="split whose images and captions are trained on")
    ap.add_argument("--dev-split", default=None,
                    help="only '' is accepted, the old spelling of --selection last (dev never selects a model)")
    ap.add_argument("--train-limit", type=int, default=None, help="only the first N training images")
    add_region_flags(ap, None)  # each defaults to the variant's
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
    _add_config_flags(ap)
    for name, typ in MODEL_OPTIONS.items():
        ap.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help="model shape (ModelConfig)")
    args = ap.parse_args(argv)
    if args.resolved:
        try:
            list_resolved(sys.stdout, variant_names() if args.variant is None else [args.variant])
        except VariantError as exc:
            ap.error(str(exc))
        return
    if args.list:
        list_variants(sys.stdout)
        return
    if args.dev_split not in (None, ""):
        ap.error("--dev-split: dev is never used to select a model (python -m bench.report evaluates it); "
                 "--selection val holds out training images instead, --selection last keeps the last epoch")
    if args.dev_split == "" and args.selection not in (None, "last"):
        ap.error("--dev-split '' means --selection last")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    if args.dev_split == "":
        overrides["selection"] = "last"
    shape = {k: getattr(args, k) for k in MODEL_OPTIONS if getattr(args, k) is not None}
    try:
        run = make_run(args.variant or "full", overrides, shape)
    except VariantError as exc:
        ap.error(str(exc))
    run.image = with_region_flags(run.image, args)
    out = args.out or default_artifacts_dir() / "models" / run.variant
    train_on(run, args.data, out, args.cache, sys.argv[1:] if argv is None else argv, split=args.train_split,
             workers=args.workers, limit=args.train_limit)


if __name__ == "__main__":
    main()
