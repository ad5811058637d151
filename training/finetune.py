"""Fine-tune the top of the backbone (the layers above the cut point: the head convolution and its batch
norm's affine part) together with a trained fragment model, on cached cut-point activations
(training/cutpoint.py), with the fragment objective: the paper's "Finetune CNN" row (§3.4, Table 3).

    python -m fragsearch.training.finetune --init artifacts/models/full-val/model.pt \\
        --acts artifacts/cache/cut/full-lite0-b16 --out artifacts/models/full-ft

The paper's schedule: the first epochs with the CNN fixed (C_0, then MIL) — the ``--init`` model, a run
of the variant with ``--selection val`` (its 10 epochs with the backbone frozen) — then the MIL objective
with the CNN's top trained too, the learning rate x0.1 for the last ``--anneal-epochs``; the validation
part (the same held-out training images as the init run's) is evaluated before the first fine-tuning
epoch and after each, and the best is kept (the paper: "freeze the model before it overfits").

A fine-tuning epoch goes through every training image once, each with one of its captions drawn anew
(``--captions-per-image``): its cost is the top's forward and backward pass on every region crop.
The kept model's backbone is written as ``backbone.pt`` (a state_dict of the whole network) beside
``model.pt``, whose image settings name it (``backbone_weights``): serving extracts features with it
(its own ONNX float and int8 graphs, made here; the feature cache key carries the digest of its weights),
and ranks proposals with the ImageNet backbone as before.

Its command line: fragsearch/commands/finetune.py (`python -m fragsearch.training.finetune` calls it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fragsearch.model.atomic import atomic_file
from fragsearch.model.dataset import SplitData
from fragsearch.model.device import fused_optimizer
from fragsearch.model.places import Places
from fragsearch.training.calibrate import fit_calibration, reference_draw
from fragsearch.training.cutpoint import CutStore
from fragsearch.training.epochs import FragmentBatches, train_fragment_epoch
from fragsearch.training.evaluate import evaluate
from fragsearch.training.nets.backbone import Top, efficientnet, onnx_graph
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel
from fragsearch.training.selection import VAL_METRICS
from fragsearch.training.train import Run

logger = logging.getLogger(__name__)

CHUNK_IMAGES = 50  # images per forward pass when the top computes features without gradients


class CutFeatures:
    """Pooled features of a list of images computed by ``top`` from their cut-point activations:
    ``feats[idx]`` (a tensor of indices into ``names``) → (B, F, 1280) with gradients to the top."""

    def __init__(self, store: CutStore, names: Sequence[str], top: torch.nn.Module, device: str = "cpu") -> None:
        self.acts = store.acts("r")
        self.rows = store.rows(names)
        self.top = top
        self.device = device

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        rows = self.rows[np.asarray(idx.cpu().numpy(), dtype=np.int64)]
        x = torch.from_numpy(np.asarray(self.acts[rows], dtype=np.float32)).to(self.device)
        b, f = x.shape[:2]
        return self.top(x.flatten(0, 1)).view(b, f, -1)

    @torch.no_grad()
    def pooled(self, idx: np.ndarray | None = None) -> np.ndarray:
        """(len(idx), F, 1280) float32 features of the images ``idx`` (default: all), without gradients."""
        idx = np.arange(len(self.rows)) if idx is None else np.asarray(idx, dtype=np.int64)
        out = [self[torch.from_numpy(idx[k : k + CHUNK_IMAGES])].cpu().numpy()
               for k in range(0, len(idx), CHUNK_IMAGES)]
        return np.concatenate(out) if out else np.zeros((0, 0, 0), np.float32)


def make_top(cut: int) -> tuple[torch.nn.Module, Top]:
    """The ImageNet network and its trainable top above ``cut`` (sharing modules): batch norm stays in eval
    mode (its running statistics fixed), its affine part and the convolutions are trained."""
    net = efficientnet()
    top = Top(net, cut).eval()
    for p in top.parameters():
        p.requires_grad_(True)
    return net, top


def one_caption_each(pair_image: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Sentence ids, ``k`` captions of each image (drawn anew, fewer where an image has fewer), shuffled."""
    perm = rng.permutation(len(pair_image))
    keep = np.zeros(len(perm), dtype=bool)
    seen = np.zeros(int(pair_image.max()) + 1 if len(pair_image) else 0, dtype=np.int64)
    for pos, sent in enumerate(perm):
        img = pair_image[sent]
        if seen[img] < k:
            seen[img] += 1
            keep[pos] = True
    return perm[keep]


def _weights_setting(path: Path, artifacts: Path) -> str:
    """How ``ImageConfig.backbone_weights`` names ``path``: relative to the artifacts folder when inside it."""
    root = artifacts.resolve()
    path = path.resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def finetune(bundle: Checkpoint, run: Run, tr: SplitData, val: SplitData, store: CutStore, out: Path,
             places: Places, *,
             epochs: int = 3, anneal_epochs: int = 1, lr: float = 1e-4, cnn_lr: float = 1e-4,
             captions_per_image: int = 1, device: str = "cpu",
             graphs: Sequence[str] = ("fp32", "int8")) -> dict[str, Any]:
    """Fine-tune ``bundle``'s fragment model and the backbone's top on ``tr``'s cut-point activations;
    keep the epoch (0 = none) with the best R-sum on ``val`` as out/model.pt + out/backbone.pt. ``places``: the
    cache the sentence vectors are read from and the served graphs are written to, and the artifacts folder the
    backbone's weights are named against."""
    model = bundle.model
    if not isinstance(model, FragmentModel):
        raise ValueError("fine-tuning needs a fragment model")
    run.train = cfg = dataclasses.replace(run.train, device=device)  # the epochs run where the top runs
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    net, top = make_top(store.cut)
    top.to(device)
    feats_tr, feats_val = CutFeatures(store, tr.names, top, device), CutFeatures(store, val.names, top, device)
    for data in (tr, val):
        bundle.text.warm(data.parsed, data.sentences, places.cache / "vectors")
    batches = FragmentBatches(bundle.text, tr, run.text.unigram_prob, device)
    refs = reference_draw(len(tr.names), len(tr.sentences), cfg.calibrate, cfg.seed)[0] if cfg.calibrate else None
    opt = torch.optim.Adam([{"params": list(model.parameters()), "lr": lr},
                            {"params": list(top.parameters()), "lr": cnn_lr}], weight_decay=cfg.weight_decay,
                           fused=fused_optimizer([*model.parameters(), *top.parameters()]))
    base = [lr, cnn_lr]
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "backbone.pt"
    best: dict[str, float] | None = None
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()

    def validate(epoch: int) -> dict[str, float]:
        nonlocal best
        val.feats = feats_val.pooled()
        if refs is not None:
            tr.feats[refs] = feats_tr.pooled(refs)
            bundle.calibration = fit_calibration(bundle, tr, cfg.calibrate, cfg.seed)
        m = evaluate(bundle, val)
        if best is None or m["rsum"] > best["rsum"]:
            best = {**m, "epoch": float(epoch)}
            with atomic_file(weights) as fh:
                torch.save(net.state_dict(), fh)
            named = _weights_setting(weights, places.artifacts)
            bundle.image_cfg = dataclasses.replace(run.image, backbone_weights=named)
            bundle.meta["selection"] = {"rule": "val", "epochs": epochs, "epoch": epoch, "images": len(val.names),
                                        "seed": cfg.val_seed, "val": best, "fine_tuned_epochs": epoch}
            bundle.save(out / "model.pt")
        return m

    m0 = validate(0)
    history.append({"epoch": 0, **{f"val_{k}": m0[k] for k in VAL_METRICS}})
    logger.info("before fine-tuning: val R-sum %.2f", m0["rsum"])
    for epoch in range(epochs):
        for g, rate in zip(opt.param_groups, base, strict=True):
            g["lr"] = rate * (0.1 if epoch >= epochs - anneal_epochs else 1.0)
        order = one_caption_each(tr.pair_image, captions_per_image, rng)
        t_ep = time.perf_counter()
        loss = train_fragment_epoch(model, run.train, feats_tr, tr, batches, opt, cfg.dense_epochs + epoch, rng, order)
        top.eval()
        row: dict[str, float] = {"epoch": epoch + 1, "loss": loss, "seconds": time.perf_counter() - t_ep}
        m = validate(epoch + 1)
        row.update({f"val_{k}": m[k] for k in VAL_METRICS})
        history.append(row)
        logger.info("fine-tuning epoch %d: %s", epoch + 1, json.dumps({k: round(v, 4) for k, v in row.items()}))
    assert best is not None
    kept = Checkpoint.load(out / "model.pt")
    if kept.image_cfg.backbone_weights:  # the served graphs, made now: float, and int8 by the same recipe
        for precision in graphs:
            onnx_graph(precision, places.graphs, weights=kept.image_cfg.backbone_weights, places=places)
    return {"selection": {"rule": "val", "epoch": int(best["epoch"]), "images": len(val.names)}, "best": best,
            "history": history, "train_seconds": time.perf_counter() - t0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "finetune": {"epochs": epochs, "anneal_epochs": anneal_epochs, "lr": lr, "cnn_lr": cnn_lr,
                         "captions_per_image": captions_per_image, "cut": store.cut, "acts": str(store.folder)}}


if __name__ == "__main__":  # `python -m fragsearch.training.finetune`, as the docs write it: the command's alias
    from fragsearch.commands.finetune import main

    main()
