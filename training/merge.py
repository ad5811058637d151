"""Merge fragment models trained on the same features and sentences into ONE fragment model: the
concatenation of their embeddings, a servable ensemble.

    python -m fragsearch.training.merge --members artifacts/models/full-val artifacts/models/full-val-seed1 \\
        artifacts/models/full-val-seed2 --out artifacts/models/full-merge3-blocks

Every encoder of a linear fragment model is linear in its weights' output rows (image: v = W x + b;
a triplet: s = ReLU(W_R [w1; w2] + b_R), ReLU acting element by element), so stacking the members' rows
gives a model of h = the sum of theirs whose fragments are the members' fragments side by side:
v . s = sum over members of v_m . s_m. With ``--threshold blocks`` (the default) the checkpoint records
its members as blocks (``ModelConfig.blocks``) and the one S_kl of model/score.py thresholds each
member's slice apart, sum_m max(0, v_m . s_m), and calibrates each slice by its own scales: the score
of an ensemble (bench/ensemble.py: the sum of the members' calibrated S_kl) in one model. With
``--threshold sum`` it is one block and S_kl thresholds the sum, max(0, sum_m v_m . s_m): a different
score (the rows full-merge2/3/6). The merged model is calibrated anew (its own references, drawn as
training draws them) and served as any checkpoint: one index of its fragments, at h = the sum of the
members'. Members must share their text pipeline (relations, word table), image settings and h: the
same variant trained on the same data. Members with MiniLM layers of their own (ModelConfig.text_layers)
must share those too: the first member trains them and the others read them fixed (TrainConfig.text_from,
what training.train does for a run of members), so the merged model reads each caption through one set.

The validation part (the members' own held-out training images) is evaluated and written to the
history beside each member alone, and the merged score's relevance scale is fitted on it (as training
fits a member's: what `min_relevance` and each result's `relevance` read); dev is for bench/report.py.

Its command line: fragsearch/commands/merge.py (`python -m fragsearch.training.merge` calls it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fragsearch.model.config import TrainConfig
from fragsearch.model.dataset import SplitData
from fragsearch.training.calibrate import fit_calibration, store_relevance
from fragsearch.training.evaluate import evaluate_scores
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel
from fragsearch.training.relevance import distractors_of, fit_relevance, judge
from fragsearch.training.selection import VAL_METRICS

logger = logging.getLogger(__name__)


THRESHOLDS = ("blocks", "sum")


def merge_models(models: Sequence[FragmentModel], threshold: str = "blocks") -> FragmentModel:
    """One fragment model whose fragments are the concatenation of the members' (see the module doc);
    `threshold` "blocks" records the members as blocks of h (thresholded apart in S_kl), "sum" as one."""
    if threshold not in THRESHOLDS:
        raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")
    first = models[0].cfg
    for m in models:
        if not isinstance(m, FragmentModel):
            raise ValueError("only fragment models can be merged")
        if m.cfg.image_hidden > 0 or m.cfg.global_hidden > 0:
            raise ValueError("only linear fragment models (image_hidden = global_hidden = 0) can be merged")
        if m.cfg.blocks != 1:
            raise ValueError("a merged model cannot be a member: merge its members instead")
        if m.cfg.pool_ranks > 0:
            raise ValueError("members pooled over ranks cannot be merged: their blocks would share one pooling")
        if m.cfg.text_layers > 0 and not same_text_layers(m, models[0]):
            raise ValueError("members with MiniLM layers of their own are merged only when the layers are one set "
                             "(the first member's, read fixed by the others: TrainConfig.text_from): a merged model "
                             "reads its words through one")
        if dataclasses.replace(m.cfg, h=first.h, input_dropout=first.input_dropout) != first:
            raise ValueError(f"members differ in shape: {m.cfg} vs {first}")
        if threshold == "blocks" and m.cfg.h != first.h:
            raise ValueError(f"members thresholded as blocks need one h: {m.cfg.h} vs {first.h}")
    merged = FragmentModel(dataclasses.replace(first, h=sum(m.cfg.h for m in models),
                                               blocks=len(models) if threshold == "blocks" else 1))
    with torch.no_grad():
        image = _linear(merged)
        image.weight.copy_(torch.cat([_linear(m).weight for m in models]))
        image.bias.copy_(torch.cat([_linear(m).bias for m in models]))
        for r in range(first.n_relations):
            merged.w_rel[r].copy_(torch.cat([m.w_rel[r] for m in models], dim=1))
            merged.b_rel[r].copy_(torch.cat([m.b_rel[r] for m in models]))
        if merged.text_layers is not None and models[0].text_layers is not None:
            merged.text_layers.load_state_dict(models[0].text_layers.state_dict())
    return merged.eval()


def same_text_layers(a: FragmentModel, b: FragmentModel) -> bool:
    """Whether two fragment models read words through the same MiniLM layers (both none, or equal weights)."""
    if a.text_layers is None or b.text_layers is None:
        return a.text_layers is None and b.text_layers is None
    sa, sb = a.text_layers.state_dict(), b.text_layers.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def _linear(model: FragmentModel) -> torch.nn.Linear:
    if not isinstance(model.image, torch.nn.Linear):
        raise ValueError("only linear image encoders can be merged")
    return model.image


def merge_bundles(bundles: Sequence[Checkpoint], threshold: str = "blocks") -> Checkpoint:
    """The merged model with the first member's text pipeline and image settings (all must agree)."""
    first = bundles[0]
    for b in bundles[1:]:
        if (b.text.relations.to_dict() != first.text.relations.to_dict() or b.text.words.words != first.text.words.words
                or b.text.cfg != first.text.cfg):
            raise ValueError("members differ in their text pipeline (relations, words or settings)")
        if b.image_cfg != first.image_cfg:
            raise ValueError("members differ in their image settings")
    models = [b.model for b in bundles]
    if not all(isinstance(m, FragmentModel) for m in models):
        raise ValueError("only fragment models can be merged")
    merged = merge_models([m for m in models if isinstance(m, FragmentModel)], threshold)
    return Checkpoint(merged, first.text, first.image_cfg, meta={"variant": first.meta.get("variant"),
                                                             "train": first.meta.get("train", {})})


def merge_selected(bundles: Sequence[Checkpoint], folders: Sequence[Path], tr: SplitData, val: SplitData | None,
                   cfg: TrainConfig, cache: Path, threshold: str = "blocks") -> tuple[Checkpoint, dict[str, Any]]:
    """The members merged (`merge_bundles`), calibrated anew on `tr` (cfg.calibrate references, as training
    draws them) and, with a validation part, evaluated on it beside each member's own selection numbers (their
    folders' history.json), its relevance scale fitted there; returns the merged bundle (not saved) and the
    summary its history.json records."""
    merged = merge_bundles(bundles, threshold)
    for d in (tr, val):
        if d is not None:
            merged.text.warm(d.parsed, d.sentences, cache / "vectors")
    if cfg.calibrate > 0:
        merged.calibration = fit_calibration(merged, tr, cfg.calibrate, cfg.seed)
    summary: dict[str, Any] = {"variant": f"merge of {len(bundles)}", "members": [str(m) for m in folders],
                               "h": merged.model.cfg.h, "blocks": merged.model.cfg.blocks,
                               "selection": {"rule": "last", "epochs": 0, "epoch": 0}}
    if val is not None:
        rows = {}
        names = [folder.name for folder in folders]
        for folder in folders:  # each member's own selection numbers, from its run
            hist = folder / "history.json"
            best = json.loads(hist.read_text()).get("best") if hist.is_file() else None
            if best:  # by folder name, by path where two members share a name (two runs' member-1)
                key = folder.name if names.count(folder.name) == 1 else str(folder)
                rows[key] = {k: best[k] for k in VAL_METRICS if k in best}
        m, scores = evaluate_scores(merged, val)
        rows["merged"] = {k: m[k] for k in VAL_METRICS}
        if merged.calibration is not None:  # the merged score's relevance scale, as training fits a member's
            try:
                store_relevance(merged, fit_relevance(judge(merged, val, distractors_of(tr, seed=cfg.seed), scores)),
                                len(val.names))
            except ValueError as e:
                logger.warning("no relevance scale for the merged model: %s", e)
        logger.info("merged on the validation part: R-sum %.2f (members: %s)", m["rsum"],
                    ", ".join(f"{n} {r.get('rsum', float('nan')):.2f}" for n, r in rows.items() if n != "merged"))
        summary["val"] = rows
        summary["selection"] = {"rule": "val", "epochs": 0, "images": len(val.names), "seed": cfg.val_seed,
                                "epoch": 0}
        summary["best"] = {**rows["merged"], "epoch": 0}
        summary["history"] = [{"epoch": 0, **{f"val_{k}": v for k, v in rows["merged"].items()}}]
        merged.meta["selection"] = {**summary["selection"], "val": rows["merged"]}
    merged.meta["merge"] = summary["members"]
    return merged, summary


if __name__ == "__main__":  # `python -m fragsearch.training.merge`, as the docs write it: the command's alias
    from fragsearch.commands.merge import main

    main()
