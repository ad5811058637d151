"""Train a fragment model (or a global baseline: two-branch, DT-RNN, SDT-RNN, DeViSE) on a data folder's train split.

    python -m fragsearch.training.train --data ../shared/data/flickr8k --variant full --out artifacts/models/full
    python -m fragsearch.training.train --list        (the variants: model/variants/*.toml, model/variants.py)
    python -m fragsearch.training.train --list --resolved [--variant full]    (every field as resolved, as TOML)

C = C_F + beta * C_G + alpha * ||theta||^2 with the paper's schedule: the first `dense_epochs`
with the dense fragment objective C_0, then its MIL form C_F; learning rate x0.1 for the last
`anneal_epochs`. The backbone is frozen (its features are cached).

Model selection never looks at dev (the split the results table reports; bench/report.py evaluates
it): with `--selection val` (the default) `--val-images` training images, drawn once with
`--val-seed` and never trained on, are held out with their captions, and the checkpoint kept is the
epoch with the best R-sum (R@1+R@5+R@10, both directions) on them; with `--selection last` every
training image is trained on and the last epoch is kept (a fixed epoch count).

Its command line: fragsearch/commands/train.py (`python -m fragsearch.training.train` calls it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import resource
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from fragsearch.model.config import (
    ImageConfig,
    TextConfig,
    TrainConfig,
)
from fragsearch.model.dataset import SplitData, load_split_data, with_mirrored
from fragsearch.model.device import device_name
from fragsearch.model.encoders import ModelConfig
from fragsearch.model.entities import read_entities
from fragsearch.model.fragments import SENTENCE_REL, TextPipeline
from fragsearch.model.parsers import make_parser
from fragsearch.model.places import Places
from fragsearch.model.text import Triplet
from fragsearch.model.trees import position_ranges
from fragsearch.model.variants import (
    MODEL_SHAPE,
    SECTIONS,
    VARIANTS_DIR,
    load_variant,
    read_variant_file,
    variant_names,
)
from fragsearch.training.boxes import sentence_labels
from fragsearch.training.calibrate import fit_calibration, store_relevance
from fragsearch.training.distill import Teacher, teacher_paths
from fragsearch.training.epochs import (
    FragmentBatches,
    ImageFeatures,
    MirroredViews,
    lr_at,
    optimizer,
    param_groups,
    train_fragment_epoch,
    train_global_epoch,
    train_two_branch_epoch,
)
from fragsearch.training.evaluate import evaluate_scores
from fragsearch.training.graphs import make_graphs
from fragsearch.training.merge import merge_selected
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import DeViSE, FragmentModel, GlobalModel, TreeRNN, TwoBranch, build_model
from fragsearch.training.relevance import distractors_of, fit_relevance, judge
from fragsearch.training.selection import VAL_METRICS, split_for_selection

logger = logging.getLogger(__name__)

OBJECTIVES = ("full", "fragment+global", "fragment", "global")
MODEL_OPTIONS = MODEL_SHAPE  # ModelConfig fields a variant or a CLI flag of the same name may set


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


def box_labels(data: SplitData, triplets: Sequence[Sequence[Triplet]]) -> list[np.ndarray | None]:
    """Box supervision's labels of the training sentences (training/boxes.py), from the Flickr30k Entities
    annotations beside the data folder (``flickr30k-entities``)."""
    root = Path(data.split.root).parent / "flickr30k-entities"
    entities = read_entities(root, data.names)
    if not entities:
        raise ValueError(f"box_supervision: no Flickr30k Entities annotations of the training images in {root}")
    return sentence_labels(triplets, data.sentences, data.pair_image, data.names, data.boxes, entities)


def train(run: Run, train_data: SplitData, val_data: SplitData | None, out: Path,
          cache_root: Path) -> dict[str, Any]:
    """Train; with `val_data` (a part held out of the training images, never dev: `hold_out`) evaluate
    on it every `eval_every` epochs and keep the best epoch as out/model.pt, without it keep the last.

    The steps: the text pipeline (`_text_for`), the model (`_model_for`), one epoch's step for its kind
    (`_epoch_step`), the epochs with their evaluation and selection (`_epochs`), the relevance scale of the
    epoch kept, the summary. Everything runs on run.train.device (resolved here: auto -> cuda when available)."""
    run.train = cfg = dataclasses.replace(run.train, device=device_name(run.train.device))
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    text, fixed = _text_for(run, train_data, val_data, cache_root)
    trees = text.encode_parsed(train_data.parsed, train_data.sentences) if run.text.fragments == "tree" else None
    model, mcfg = _model_for(run, text, fixed, trees, train_data.feats.shape[-1])
    bundle = Checkpoint(model, text, run.image, meta={"variant": run.variant, "train": dataclasses.asdict(cfg)})
    feats = torch.from_numpy(train_data.feats)
    if run.image.full_frame_only:
        feats = feats[:, :1].contiguous()
    opt = optimizer(cfg, param_groups(cfg, model))
    t0 = time.perf_counter()
    step = _epoch_step(run, model, text, fixed, trees, train_data, feats, opt, rng, cache_root)
    logger.info("training %s on %s: %d images, %d sentences, %d relations, h=%d (prep %.1fs)", run.variant,
                cfg.device, len(train_data.names), len(train_data.sentences), len(text.relations), cfg.h,
                time.perf_counter() - t0)
    selection, best, history = _epochs(bundle, cfg, opt, step, train_data, val_data, out)
    if val_data is not None and best is not None and cfg.calibrate > 0 and isinstance(model, FragmentModel):
        kept = Checkpoint.load(out / "model.pt", device=cfg.device)  # the epoch kept gets its relevance scale
        try:
            store_relevance(kept, fit_relevance(judge(kept, val_data, distractors_of(train_data, seed=cfg.seed))),
                            len(val_data.names))
            kept.save(out / "model.pt")
        except ValueError as e:  # a score that does not separate: the model has no scale
            logger.warning("no relevance scale: %s", e)
    summary = {"variant": run.variant, "selection": selection, "best": best, "history": history,
               "train_images": len(train_data.names), "train_sentences": len(train_data.sentences),
               "train_seconds": time.perf_counter() - t0,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "config": {"train": dataclasses.asdict(cfg), "text": dataclasses.asdict(run.text),
                          "image": dataclasses.asdict(run.image), "model": mcfg.to_dict()}}
    (out / "history.json").write_text(json.dumps(summary, indent=2))
    return summary


def _text_for(run: Run, train_data: SplitData, val_data: SplitData | None, cache_root: Path
              ) -> tuple[TextPipeline, Checkpoint | None]:
    """The run's text pipeline fitted on the training captions, its vectors warmed for both parts, and the
    checkpoint whose MiniLM layers it reads fixed (`text_from`), if any."""
    cfg = run.train
    text = TextPipeline.fit(run.text, train_data.parsed, cache_root / "words")
    text.device = cfg.device
    fixed = fixed_text_layers(cfg, run) if cfg.text_from else None
    if fixed is not None:  # words and sentences read through the fixed layers, as the merged model reads them
        text.use_layers(fixed.text.layers)
    for data in (train_data, val_data):
        if data is not None:
            text.warm(data.parsed, data.sentences, cache_root / "vectors")
    return text, fixed


def _model_for(run: Run, text: TextPipeline, fixed: Checkpoint | None, trees: Any, img_dim: int
               ) -> tuple[FragmentModel | GlobalModel, ModelConfig]:
    """The model of the run's kind and shape, on the run's device: its MiniLM layers (where it has its own)
    from `fixed` (read, never trained) or from MiniLM's weights."""
    cfg = run.train
    sid = text.relations.index(SENTENCE_REL)
    shape = {k: v for k, v in run.model_overrides.items() if k in MODEL_OPTIONS}
    if fixed is not None:
        shape["text_layers"] = fixed.cfg.text_layers
    if trees is not None and trees.trees is not None:
        shape["tree_left"], shape["tree_right"] = position_ranges(trees.trees)
    mcfg = ModelConfig(kind=run.model_kind, h=cfg.h, n_relations=len(text.relations), img_dim=img_dim,
                       word_dim=text.words.dim, sentence_relation=-1 if sid is None else sid, **shape)
    model = build_model(mcfg)
    if isinstance(model, FragmentModel) and model.text_layers is not None:
        if fixed is not None and isinstance(fixed.model, FragmentModel) and fixed.model.text_layers is not None:
            model.text_layers.load_state_dict(fixed.model.text_layers.state_dict())
            model.text_layers.requires_grad_(False)  # read, never trained (param_groups leaves them out)
        else:
            model.text_layers.load_minilm()  # trained from MiniLM's own weights of those layers
    return model.to(cfg.device), mcfg


def _epoch_step(run: Run, model: FragmentModel | GlobalModel, text: TextPipeline, fixed: Checkpoint | None, trees: Any,
                train_data: SplitData, feats: torch.Tensor, opt: torch.optim.Optimizer, rng: np.random.Generator,
                cache_root: Path) -> Callable[[int], float]:
    """One epoch of training for the model's kind (epoch number → its mean loss): the two-branch
    embedding's, a global model's over sentence trees (DT-RNN, DeViSE), or the fragment objective's (with its
    box labels, mirrored views and teacher where the run asks for them)."""
    cfg = run.train
    if isinstance(model, TwoBranch):
        enc = text.encode_parsed(train_data.parsed, train_data.sentences)
        sent_vecs = torch.from_numpy(enc.extra).float()  # one sentence fragment each, in order
        return lambda e: train_two_branch_epoch(model, cfg, feats, train_data, sent_vecs, opt, e, rng)
    if isinstance(model, TreeRNN | DeViSE):
        if trees is None:
            raise ValueError(f"a {run.model_kind} model composes sentences from their trees: text fragments 'tree'")
        pool = torch.from_numpy(np.concatenate([text.words.vectors, trees.extra])).float().to(cfg.device)
        global_model = model
        return lambda e: train_global_epoch(global_model, cfg, feats, train_data, trees, pool, opt, e, rng)
    tuned = (model.text_layers.first if model.text_layers is not None and fixed is None
             else None)  # fixed layers: the pipeline's vectors are read through them already
    batches = FragmentBatches(text, train_data, run.text.unigram_prob, cfg.device, tuned, cache_root / "vectors")
    if cfg.box_supervision:
        batches.labels = box_labels(train_data, batches.enc.triplets)
    views: ImageFeatures = feats
    if cfg.mirror_views > 0:
        if train_data.mirrored is None:
            raise ValueError("mirror_views: the training images' mirrored view was not loaded (with_mirrored)")
        views = MirroredViews(feats, torch.from_numpy(train_data.mirrored), cfg.mirror_views, rng)
    if cfg.distill_from and cfg.mirror_views > 0:
        raise ValueError("distill_from with mirror_views: the teacher scores the images unmirrored")
    teacher = (Teacher(teacher_paths(cfg.distill_from), text, run.image, feats, cfg.device,
                       images=[train_data.split.image_path(n) for n in train_data.names], cache_root=cache_root)
               if cfg.distill_from else None)
    return lambda e: train_fragment_epoch(model, cfg, views, train_data, batches, opt, e, rng, teacher=teacher)


def _epochs(bundle: Checkpoint, cfg: TrainConfig, opt: torch.optim.Optimizer, step: Callable[[int], float],
            train_data: SplitData, val_data: SplitData | None, out: Path
            ) -> tuple[dict[str, Any], dict[str, float] | None, list[dict[str, float]]]:
    """The epochs: each one's learning rate and step; with a validation part its evaluation every
    `eval_every` epochs (and at the last), the best R-sum's epoch saved as out/model.pt, else the last epoch
    saved; a fragment model's calibration refitted before each evaluation → (the selection, the best
    epoch's metrics or None, one row per epoch)."""
    model = bundle.model
    history: list[dict[str, float]] = []
    best: dict[str, float] | None = None
    selection: dict[str, Any] = (
        {"rule": "last", "epochs": cfg.epochs} if val_data is None else
        {"rule": "val", "epochs": cfg.epochs, "images": len(val_data.names), "seed": cfg.val_seed})
    out.mkdir(parents=True, exist_ok=True)
    for epoch in range(cfg.epochs):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, epoch, g["base_lr"])
        t_ep = time.perf_counter()
        loss = step(epoch)
        row: dict[str, float] = {"epoch": epoch + 1, "loss": loss, "seconds": time.perf_counter() - t_ep}
        last = epoch == cfg.epochs - 1
        evaluated = val_data is not None and ((epoch + 1) % cfg.eval_every == 0 or last)
        if cfg.calibrate > 0 and isinstance(model, FragmentModel) and (evaluated or last):
            bundle.calibration = fit_calibration(bundle, train_data, cfg.calibrate, cfg.seed)
            bundle.meta["calibration"] = {"refs": cfg.calibrate, "split": "train", "seed": cfg.seed}
        if evaluated and val_data is not None:
            m, _ = evaluate_scores(bundle, val_data)
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
    return selection, best, history


def fixed_text_layers(cfg: TrainConfig, run: Run) -> Checkpoint:
    """The checkpoint of `cfg.text_from`, checked: a fragment model with its own MiniLM layers, as many as the
    run's `text_layers` where it names them; its layers are read fixed (not trained) by the model being trained."""
    src = Checkpoint.load(Path(cfg.text_from))
    if not isinstance(src.model, FragmentModel) or src.model.text_layers is None:
        raise ValueError(f"text_from {cfg.text_from}: the model has no MiniLM layers of its own to read")
    asked = int(run.model_overrides.get("text_layers", 0))
    if asked and asked != src.cfg.text_layers:
        raise ValueError(f"text_from {cfg.text_from} has {src.cfg.text_layers} MiniLM layers of its own, the run "
                         f"asks for {asked}")
    if run.model_kind != "fragment":
        raise ValueError(f"text_from: a {run.model_kind} model reads no MiniLM layers of its own")
    if cfg.distill_from:
        raise ValueError("text_from with distill_from: a teacher reads MiniLM's own vectors, the student's pipeline "
                         "reads them through the fixed layers")
    return src


def train_members(run: Run, train_data: SplitData, val_data: SplitData | None, out: Path,
                  cache_root: Path) -> dict[str, Any]:
    """`run.train.members` runs of `run` from seeds seed, seed + 1, ... (each `train`ed into out/member-<n>, its
    epoch kept by the selection rule), merged into out/model.pt with each member's S_kl thresholded apart
    (training.merge.merge_selected: calibrated anew, evaluated on the validation part when there is one)."""
    cfg = run.train
    if cfg.members < 2:
        raise ValueError(f"members must be at least 2 to merge, not {cfg.members}")
    hidden = [k for k in ("image_hidden", "global_hidden") if int(run.model_overrides.get(k, 0)) > 0]
    own_layers = int(run.model_overrides.get("text_layers", 0)) > 0 and not cfg.text_from
    if run.model_kind != "fragment" or hidden:  # what training.merge can stack, checked before any training
        raise ValueError(f"members are merged as linear fragment models; {run.variant} is a {run.model_kind} model"
                         + (f" with {', '.join(hidden)}" if hidden else ""))
    t0 = time.perf_counter()
    folders: list[Path] = []
    kept = []
    for m in range(cfg.members):
        folder = out / f"member-{m + 1}"
        logger.info("member %d of %d (seed %d) into %s", m + 1, cfg.members, cfg.seed + m, folder)
        # with MiniLM layers of its own, the first member trains them and the others read them fixed (text_from):
        # the merged model reads every caption through one set of layers
        text_from = str(folders[0] / "model.pt") if own_layers and m > 0 else cfg.text_from
        member = dataclasses.replace(run, train=dataclasses.replace(cfg, seed=cfg.seed + m, members=1,
                                                                    text_from=text_from))
        kept.append(int(train(member, train_data, val_data, folder, cache_root)["selection"]["epoch"]))
        folders.append(folder)
    bundles = [Checkpoint.load(f / "model.pt") for f in folders]
    merged, summary = merge_selected(bundles, folders, train_data, val_data, cfg, cache_root)
    merged.meta["variant"] = run.variant
    merged.save(out / "model.pt")
    summary["variant"] = run.variant
    summary["member_epochs"] = kept  # each member's epoch kept by the selection rule
    summary["train_seconds"] = time.perf_counter() - t0
    return summary


@dataclass(frozen=True)
class Trained:
    """What a training run left in its folder: the checkpoint and the epoch kept (its history.json holds the
    rest: every epoch's loss and validation metrics, the resolved settings, the command that reproduces it)."""

    variant: str
    checkpoint: Path  # <out>/model.pt
    selection: str  # "val" or "last" (TrainConfig.selection)
    epoch: int  # the epoch kept (a merge of members: 0, the merge has no epochs of its own)
    epochs: int
    seconds: float  # training, features excluded
    member_epochs: tuple[int, ...] = ()  # a run of members: each member's epoch kept


def train_on(run: Run, data: Path, out: Path, cache: Path, flags: list[str], *, split: str = "train",
             workers: int = 2, limit: int | None = None, places: Places | None = None) -> Trained:
    """Train `run` on the `split` images of the data folder (the first `limit`; features extracted into
    `cache` where missing), keep the epoch its selection rule picks as out/model.pt, and write
    out/history.json with the command line `flags` of `python -m fragsearch.training.train` give. The graphs its
    extraction runs are made first where missing (the export step, training/graphs.py) in the graph folder of
    `places` (default: the artifacts default and `cache`)."""
    make_graphs(run.image, places or Places(cache=cache))
    device = device_name(run.train.device)
    images = load_split_data(data, split, run.image, cache, make_parser(run.text.parser), workers, limit, device)
    tr, val = split_for_selection(run.train, images)
    if run.train.mirror_views > 0:  # the images trained on only: the validation part is never mirrored
        tr = with_mirrored(tr, run.image, cache, workers, device)
    summary = train_members(run, tr, val, out, cache) if run.train.members > 1 else train(run, tr, val, out, cache)
    summary["command"] = "python -m fragsearch.training.train " + shlex.join(flags)
    (out / "history.json").write_text(json.dumps(summary, indent=2))
    kept = summary["selection"]
    members = tuple(summary.get("member_epochs", ()))
    if members:
        logger.info("merged %d members, epochs %s of %d kept (%s)", len(members), list(members), run.train.epochs,
                    run.train.selection)
    else:
        logger.info("kept epoch %d of %d (%s)", kept["epoch"], run.train.epochs, kept["rule"])
    return Trained(run.variant, out / "model.pt", kept["rule"], kept["epoch"], run.train.epochs,
                   summary["train_seconds"], members)


def train_variant(variant: str, data: Path, out: Path, selection: str, *, cache: Path, workers: int = 2,
                  device: str = "auto", limit: int | None = None, places: Places | None = None) -> Trained:
    """Train the variant as its file gives it (model/variants/<variant>.toml) on the data folder's training
    split, keeping the epoch `selection` ("val" or "last") picks: what a first start calls when its model
    is missing (service/prepare.py). An unknown variant raises VariantError before any extraction."""
    run = make_run(variant, {"selection": selection, "device": device})
    flags = ["--data", str(data), "--variant", variant, "--out", str(out), "--cache", str(cache),
             "--workers", str(workers), "--device", device, "--selection", selection]
    if limit is not None:
        flags += ["--train-limit", str(limit)]
    return train_on(run, data, out, cache, flags, workers=workers, limit=limit, places=places)


if __name__ == "__main__":  # `python -m fragsearch.training.train`, as the docs write it: the command's alias
    from fragsearch.commands.train import main

    main()
