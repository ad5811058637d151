"""Score calibration: fitting the reference sets and the relevance scale (model/calibration.py holds
the data and its maths), timing it, and the command line that calibrates a trained checkpoint.

The reference sets are drawn from the training split (`fit_calibration`), embedded by the
uncalibrated model and stored in the checkpoint; `per_item_ms` measures what the scale costs a query.
The relevance scale (`fit_relevance`) is a logistic curve of the calibrated S_kl fitted on the
validation part of the training data (the images --selection val held out, never dev): training
fits it at every evaluated epoch, this command refits it for a checkpoint (`--relevance-only` keeps
the reference sets, e.g. to add the scale to a checkpoint made before it existed).

    python -m training.calibrate --model artifacts/models/full/model.pt --refs 1000
    python -m training.calibrate --model artifacts/models/full-val/model.pt --relevance-only \
        --out artifacts/models/full-val-relevance/model.pt
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from model.bundle import Bundle
from model.calibration import Calibration, Relevance
from model.config import default_artifacts_dir, default_data_dir
from model.dataset import SplitData, hold_out, load_split_data
from model.nets.checkpoint import Checkpoint
from model.onnx import default_threads
from model.parsers import make_parser
from model.score import block_slices
from training.evaluate import evaluate, evaluate_scores

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
    cal = Calibration(img, sent, mask)
    parts = block_slices(img.shape[-1], bundle.blocks)
    cal.floor_image = FLOOR * float(np.median(np.concatenate([cal.image_scales(cal.ref_images[..., p], p)
                                                              for p in parts])))
    sent_scales = [cal.sentence_scales(cal.ref_sentences[..., p], cal.ref_sentence_mask, p) for p in parts]
    cal.floor_sentence = FLOOR * float(np.median(np.concatenate(sent_scales)))
    return cal


RIDGE = 1e-3  # L2 penalty of the logistic fit (keeps it finite when the two kinds of pairs separate)


def true_and_random_pairs(scores: np.ndarray, pair_image: np.ndarray, seed: int = 0
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Scores of every sentence with its own image, and with one other image drawn at random:
    scores (N_images, L), pair_image (L,) -> (true (L,), random (L,))."""
    n, n_sent = scores.shape
    cols = np.arange(n_sent)
    rng = np.random.default_rng(seed)
    other = (pair_image + rng.integers(1, n, size=n_sent)) % n  # never the sentence's own image
    return scores[pair_image, cols], scores[other, cols]


def fit_relevance(scores: np.ndarray, pair_image: np.ndarray, seed: int = 0, steps: int = 50) -> Relevance:
    """The logistic curve P(true pair | S) fitted by Newton's method on the true pairs and as many
    random ones of a score matrix (the validation part's): equal numbers, so 0.5 is even odds."""
    true, rand = true_and_random_pairs(scores, pair_image, seed)
    x = np.concatenate([true, rand]).astype(np.float64)
    y = np.concatenate([np.ones(len(true)), np.zeros(len(rand))])
    design = np.stack([x, np.ones_like(x)], axis=1)
    w = np.zeros(2)
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-np.clip(design @ w, -60, 60)))
        grad = design.T @ (p - y) + RIDGE * w
        hess = (design * (p * (1 - p))[:, None]).T @ design + RIDGE * np.eye(2)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    if w[0] <= 0:
        raise ValueError("the score does not separate true pairs from random ones: no relevance scale")
    return Relevance(float(w[0]), float(w[1]))


def validation_part(bundle: Checkpoint, data: SplitData) -> SplitData:
    """The training images the checkpoint's --selection val held out (model selection's part)."""
    train = bundle.meta.get("train", {})
    if train.get("selection") != "val":
        raise ValueError("the checkpoint was not trained with --selection val: it has no validation part to fit "
                         "the relevance scale on (retrain with --selection val)")
    return hold_out(data, int(train["val_images"]), int(train["val_seed"]))[1]


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="checkpoint to calibrate (rewritten in place)")
    ap.add_argument("--out", type=Path, default=None, help="write the calibrated checkpoint here instead")
    ap.add_argument("--relevance-only", action="store_true",
                    help="keep the reference sets and refit only the relevance scale (on the validation part)")
    ap.add_argument("--data", type=Path, default=default_data_dir(),
                    help="the Flickr8K folder (default: FRAGSEARCH_DATA or ../shared/data/flickr8k)")
    ap.add_argument("--split", default="train", help="where the reference items are drawn from")
    ap.add_argument("--dev-split", default="dev",
                    help="evaluated before and after ('' to skip)")
    ap.add_argument("--cache", type=Path, default=default_artifacts_dir() / "cache",
                    help="the feature, parse and vector cache (git-ignored); default: artifacts/cache")
    ap.add_argument("--refs", type=int, default=1000, help="reference images and sentences (0 removes calibration)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the reference draw")
    ap.add_argument("--workers", type=int, default=1, help="feature extraction processes")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bundle = Checkpoint.load(args.model, device=args.device)
    device = str(bundle.device)
    if bundle.cfg.kind != "fragment":
        raise SystemExit(f"{args.model}: only fragment models are calibrated (this one is {bundle.cfg.kind!r})")
    parser = make_parser(bundle.text.cfg.parser)
    dev = (load_split_data(args.data, args.dev_split, bundle.image_cfg, args.cache, parser, args.workers,
                           device=device) if args.dev_split else None)
    if dev is not None:
        bundle.text.warm(dev.parsed, dev.sentences, args.cache / "vectors")
    train = load_split_data(args.data, args.split, bundle.image_cfg, args.cache, parser, args.workers,
                            device=device) if args.refs > 0 or args.relevance_only else None
    out = args.out or args.model
    if args.relevance_only:
        if bundle.calibration is None or train is None:
            raise SystemExit(f"{args.model} is not calibrated: calibrate it first (without --relevance-only)")
        fit_relevance_on_validation(bundle, train, args.cache)
        bundle.save(out)
        logger.info("wrote %s", out)
        return
    bundle.calibration = None
    before = evaluate(bundle, dev) if dev is not None else None
    if args.refs > 0 and train is not None:
        bundle.calibration = fit_calibration(bundle, train, args.refs, args.seed)
        bundle.meta["calibration"] = {"refs": args.refs, "split": args.split, "seed": args.seed}
        if bundle.meta.get("train", {}).get("selection") == "val":
            fit_relevance_on_validation(bundle, train, args.cache)
        else:
            logger.warning("no validation part in %s (not trained with --selection val): no relevance scale",
                           args.model)
    else:
        bundle.meta.pop("calibration", None)
    bundle.meta.pop("dev", None)  # measured with the previous scales
    if dev is not None:
        after = evaluate(bundle, dev)
        bundle.meta["dev"] = after
        keys = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10")
        logger.info("dev without calibration: %s", json.dumps({k: round(before[k], 1) for k in keys} if before else {}))
        logger.info("dev with calibration:    %s", json.dumps({k: round(after[k], 1) for k in keys}))
        if bundle.calibration is not None:
            cost = per_item_ms(bundle.bundle(), dev)
            bundle.meta["calibration"]["ms_per_item"] = cost
            logger.info("median ms to embed one item (dev, %d threads): %s", default_threads(), json.dumps(cost))
    bundle.save(out)
    logger.info("wrote %s", out)


def fit_relevance_on_validation(bundle: Checkpoint, train: SplitData, cache: Path) -> None:
    """Fit the relevance scale on the validation part of `train` and store it with the calibration."""
    val = validation_part(bundle, train)
    bundle.text.warm(val.parsed, val.sentences, cache / "vectors")
    _, scores = evaluate_scores(bundle, val)
    store_relevance(bundle, fit_relevance(scores, val.pair_image), len(val.names))


def store_relevance(bundle: Checkpoint, rel: Relevance, images: int) -> None:
    """Put the relevance scale beside the calibration's reference sets (and its numbers in the meta)."""
    assert bundle.calibration is not None
    bundle.calibration.relevance = rel
    bundle.meta["calibration"] = {**bundle.meta.get("calibration", {}), "relevance": {
        **rel.to_state(), "images": images, "split": "validation part"}}
    logger.info("relevance scale on %d validation images: slope %.4f, intercept %.4f (S at 0.5: %.4f)",
                images, rel.slope, rel.intercept, rel.score_at(0.5))


if __name__ == "__main__":
    main()
