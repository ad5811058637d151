"""Score calibration: fitting the reference sets and the relevance scale (model/calibration.py holds
the data and its maths), timing it, and the command line that calibrates a trained checkpoint.

The reference sets are drawn from the training split (`fit_calibration`), embedded by the
uncalibrated model and stored in the checkpoint; `per_item_ms` measures what the scale costs a query.
The relevance scale (its form in model/calibration.py) is fitted by training/relevance.py `fit_relevance` on the
validation part of the training data (the images --selection val held out, never dev).
Training fits it for the epoch it keeps; this command refits it for a checkpoint or a model in the runtime's
form (`--relevance-only` keeps the reference sets, e.g. to add the scale to a checkpoint made before it
existed).

    python -m fragsearch.training.calibrate --model artifacts/models/full/model.pt --refs 1000
    python -m fragsearch.training.calibrate --model artifacts/models/full-val/model.pt --relevance-only \
        --out artifacts/models/full-val-relevance/model.pt
    python -m fragsearch.training.calibrate --model model/released --relevance-only --local-k 5,10,20,50 \
        --out artifacts/models/release-local   # a local scale chosen on the validation part, then the curve

Its command line: fragsearch/commands/calibrate.py (`python -m fragsearch.training.calibrate` calls it).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Calibration, Relevance
from fragsearch.model.dataset import SplitData, hold_out, load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.model.places import Places
from fragsearch.model.score import block_slices
from fragsearch.training.evaluate import evaluate
from fragsearch.training.graphs import make_graphs
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.relevance import distractors_of, fit_relevance, judge

logger = logging.getLogger(__name__)

FLOOR = 0.01  # smallest scale, as a share of the reference items' median scale (an all-zero item)


def reference_draw(n_images: int, n_sentences: int, refs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The (sorted) indices of the reference images and sentences `fit_calibration` draws."""
    rng = np.random.default_rng(seed)
    img_idx = np.sort(rng.choice(n_images, min(refs, n_images), replace=False))
    sent_idx = np.sort(rng.choice(n_sentences, min(refs, n_sentences), replace=False))
    return img_idx, sent_idx


def fit_calibration(bundle: Checkpoint, data: SplitData, refs: int, seed: int = 0) -> Calibration:
    """Reference sets of `refs` images and `refs` sentences drawn from `data` (the training split),
    embedded by the bundle's model without calibration; floors from the references' own scales (of every
    block of a merged model)."""
    img_idx, sent_idx = reference_draw(len(data.names), len(data.sentences), refs, seed)
    enc = bundle.text.encode_parsed([data.parsed[i] for i in sent_idx], [data.sentences[i] for i in sent_idx])
    img = bundle.embed_images(data.feats[img_idx], calibrated=False)
    sent, mask = bundle.embed_sentences(enc, calibrated=False)
    cal = Calibration(img, sent, mask, pool=bundle.pool)
    parts = block_slices(img.shape[-1], bundle.blocks)
    cal.floor_image = FLOOR * float(np.median(np.concatenate([cal.image_scales(cal.ref_images[..., p], p)
                                                              for p in parts])))
    sent_scales = [cal.sentence_scales(cal.ref_sentences[..., p], cal.ref_sentence_mask, p) for p in parts]
    cal.floor_sentence = FLOOR * float(np.median(np.concatenate(sent_scales)))
    return cal


def split_of(bundle: Checkpoint | Bundle, data: SplitData) -> tuple[SplitData, SplitData]:
    """(the images trained on, the validation part): the training images the checkpoint's --selection val
    held out (model selection's part) and the rest."""
    train = bundle.meta.get("train", {})
    if train.get("selection") != "val":
        raise ValueError("the checkpoint was not trained with --selection val: it has no validation part to fit "
                         "the relevance scale on (retrain with --selection val)")
    return hold_out(data, int(train["val_images"]), int(train["val_seed"]))


def validation_part(bundle: Checkpoint, data: SplitData) -> SplitData:
    """The training images the checkpoint's --selection val held out (model selection's part)."""
    return split_of(bundle, data)[1]


def per_item_ms(bundle: Bundle, data: SplitData, n: int = 50) -> dict[str, float]:
    """Milliseconds to embed one image / one sentence at a time (as a query is), with and without
    the calibration scale, measured interleaved on the first `n` items of `data`."""
    enc = bundle.text.encode_parsed(data.parsed[:n], data.sentences[:n])
    times: dict[str, list[float]] = {k: [] for k in ("image", "image_calibrated", "sentence", "sentence_calibrated")}
    for i in range(min(n, len(data.names), len(enc.rel))):
        for cal in (False, True):
            t = time.perf_counter()
            bundle.embed_images(data.feats[i : i + 1], calibrated=cal)
            times["image_calibrated" if cal else "image"].append(time.perf_counter() - t)
            t = time.perf_counter()
            bundle.embed_sentences(enc, [i], calibrated=cal)
            times["sentence_calibrated" if cal else "sentence"].append(time.perf_counter() - t)
    return {k: round(1000 * float(np.median(v)), 2) for k, v in times.items() if v}


def fit_relevance_on_validation(bundle: Checkpoint, train: SplitData, cache: Path) -> None:
    """Fit the relevance scale on the validation part of `train` (the rest's distractors beside it) and store
    it with the calibration."""
    rest, val = split_of(bundle, train)
    bundle.text.warm(val.parsed, val.sentences, cache / "vectors")
    store_relevance(bundle, fit_relevance(judge(bundle, val, distractors_of(rest))), len(val.names))


def choose_local_scale(bundle: Checkpoint | Bundle, val: SplitData, ks: list[int], powers: list[float]
                       ) -> dict[str, Any]:
    """The local scale (model/calibration.py `Calibration.localised`) of the best validation R-sum among
    `ks` x `powers` and the spread alone (power 0; the first of equals is kept), set on the bundle's
    calibration: what was chosen, the validation metrics with it and every candidate's R-sum."""
    assert bundle.calibration is not None
    base = bundle.calibration
    if base.local_power > 0:
        base = replace(base, local_k=0, local_power=0.0)
    local = base.localised(1, 1.0, bundle.blocks)  # the references' own spreads, whatever k and p
    grid: list[dict[str, Any]] = []
    best: tuple[float, Calibration, dict[str, float]] | None = None
    for k, power in [(0, 0.0), *((k, p) for k in ks for p in powers if p > 0 and k > 0)]:
        bundle.calibration = replace(local, local_k=k, local_power=power) if power > 0 else base
        metrics = evaluate(bundle, val)
        grid.append({"local_k": k, "local_power": power, "val_rsum": round(metrics["rsum"], 2)})
        logger.info("local scale k=%d power=%.2f: validation R-sum %.2f", k, power, metrics["rsum"])
        if best is None or metrics["rsum"] > best[0]:
            best = (metrics["rsum"], bundle.calibration, metrics)
    assert best is not None
    bundle.calibration = best[1]
    chosen = {"local_k": best[1].local_k, "local_power": best[1].local_power}
    logger.info("chosen on the validation part: %s (R-sum %.2f)", json.dumps(chosen), best[0])
    return {**chosen, "val": best[2], "grid": grid}


def refit_relevance(model: Path, out: Path, data: Path, cache: Path, workers: int = 1, device: str = "auto",
                    local: tuple[list[int], list[float]] | None = None) -> None:
    """Refit the relevance scale of a calibrated checkpoint (.pt) or a model in the runtime's form (its folder
    or model.json; written as a folder) on its validation part, the rest of the training split beside it;
    with `local` (k values, powers), first choose the local scale on that part (`choose_local_scale`): the
    validation metrics the model carries are then those of the chosen scale."""
    runtime = Path(model).suffix != ".pt"
    bundle: Bundle | Checkpoint = (Bundle.load(model, device=device) if runtime
                                   else Checkpoint.load(model, device=device))
    if bundle.calibration is None:
        raise SystemExit(f"{model} is not calibrated: calibrate it first (without --relevance-only)")
    train = bundle.meta.get("train", {})
    if train.get("selection") != "val":
        raise SystemExit(f"{model} was not trained with --selection val: it has no validation part to fit the "
                         "relevance scale on (retrain with --selection val)")
    parser = make_parser(bundle.text.cfg.parser)
    make_graphs(bundle.image_cfg, Places(cache=cache))  # the export step: what its extraction runs
    rest, val = split_of(bundle, load_split_data(data, "train", bundle.image_cfg, cache, parser, workers,
                                                 device=str(bundle.device)))
    others = distractors_of(rest)
    for part in (val, others):
        bundle.text.warm(part.parsed, part.sentences, cache / "vectors")
    if local is not None:
        chosen = choose_local_scale(bundle, val, *local)
        bundle.meta["calibration"] = {**bundle.meta.get("calibration", {}),
                                      "local": {k: chosen[k] for k in ("local_k", "local_power", "grid")}}
        selection = bundle.meta.setdefault("selection", {})
        selection["val"] = chosen["val"]
        selection["local_scale"] = "best validation R-sum (training.calibrate --local-k/--local-power)"
        bundle.meta.pop("dev", None)  # measured with the previous scales
    try:
        rel = fit_relevance(judge(bundle, val, others))
    except ValueError as e:
        raise SystemExit(f"{model}: no relevance scale on its validation part of {len(val.names)} images ({e}); "
                         "nothing written") from e
    store_relevance(bundle, rel, len(val.names))
    written = bundle.save(Path(out).parent if runtime and Path(out).suffix == ".json" else out)
    logger.info("wrote %s", written or out)


def store_relevance(bundle: Checkpoint | Bundle, rel: Relevance, images: int) -> None:
    """Put the relevance scale beside the calibration's reference sets (and its numbers in the meta)."""
    assert bundle.calibration is not None
    bundle.calibration.relevance = rel
    bundle.meta["calibration"] = {**bundle.meta.get("calibration", {}), "relevance": {
        **rel.to_state(), "images": images, "split": "validation part"}}
    logger.info("relevance scale on %d validation images: %s", images, json.dumps(rel.to_state()))


if __name__ == "__main__":  # `python -m fragsearch.training.calibrate`, as the docs write it: the command's alias
    from fragsearch.commands.calibrate import main

    main()
