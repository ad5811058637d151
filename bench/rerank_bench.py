"""Query-time re-ranking with the other side: does subtracting an item's local density from its score
(CSLS, the additive form: S - lambda * m, m the mean of the item's k best scores on the other side) move
the ranking, beyond the released model's calibration?

    python -m bench.rerank_bench --out docs/results/rerank-dev.csv

Two banks of the other side, each a re-rank a service could run over its top candidates:

- `references`: the calibration's reference items (1,000 training images and 1,000 training sentences,
  in the model): m of an image is the mean of its k best scores against the reference sentences (search),
  m of a sentence that against the reference images (annotation). Known for every item when it is
  embedded, as its scale is.
- `collection`: m of a sentence is the mean of its k best scores against the images of the collection
  searched, the query image left out (an upload is not in the collection); m of an image that against
  the collection's sentences, the query sentence left out. Here every caption's own image is in the
  collection and every image's own captions are among its sentences: the evaluation's structure.
- `other`: the same against another collection of the same kind that lacks that structure: for the
  validation part, the dev images and captions; for dev, the validation part's. What a collection
  re-rank is worth where the other side does not hold the items' own matches (a photo collection
  ranked against a caption bank of other photos).
- `collection-kept`: `collection` with the query kept in each density (what a service that cannot tell
  the query among its items would compute).
- `neighbours` (search only): the same side instead, a boost: S + lambda * the mean score of the image's k
  nearest images of the collection (cosine of their whole-image CNN features), database-side
  augmentation. (In annotation a sentence's nearest sentences would be its own image's other captions:
  the evaluation's structure again.)

k and lambda are chosen on the validation part (the training images the model was trained without) by
R-sum of the direction the bank acts on, no re-rank (k = 0) among the candidates; dev is evaluated once
with the choice. Writes the CSV (per
bank and direction: the choice, validation and dev R-sum of that direction, before and after) and
prints it.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine, parse_run, write_rows
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import SplitData, held_out_split, load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.settings import default_cache_dir, default_data_dir, default_model_path
from fragsearch.training.evaluate import KS, annotation_ranks, recall_table, score_split, search_ranks

logger = logging.getLogger("bench.rerank_bench")
KS_DENSITY = (1, 3, 5, 10, 20, 50)
LAMBDAS = (0.25, 0.5, 0.75, 1.0)


def top_mean(scores: np.ndarray, k: int, axis: int) -> np.ndarray:
    """The mean of the k largest entries along `axis`."""
    k = min(k, scores.shape[axis])
    return np.asarray(-np.partition(-scores, k - 1, axis=axis).take(np.arange(k), axis=axis)).mean(axis=axis)


def top_mean_leaving_out_each(scores: np.ndarray, k: int) -> np.ndarray:
    """(N, L): for image i and sentence l, the mean of l's k best scores over the images other than i."""
    n = scores.shape[0]
    k = min(k, n - 1)
    order = np.argsort(-scores, axis=0, kind="stable")[: k + 1]  # (k+1, L) the best images of each sentence
    best = np.take_along_axis(scores, order, axis=0)
    with_all = best[:k].sum(axis=0)  # (L,)
    out = np.repeat((with_all / k)[None, :], n, axis=0)
    for j in range(k):  # image order[j] among the k best: its place is taken by the (k+1)-th
        rows, cols = order[j], np.arange(scores.shape[1])
        out[rows, cols] = (with_all - best[j] + best[k]) / k
    return out


def top_mean_leaving_out_each_sentence(scores: np.ndarray, k: int) -> np.ndarray:
    """(N, L): for image i and sentence l, the mean of i's k best scores over the sentences other than l."""
    return top_mean_leaving_out_each(scores.T, k).T


def rsum(ranks: np.ndarray) -> float:
    table = recall_table(ranks, "x")
    return float(sum(table[f"x_r{k}"] for k in KS))


def direction_rsum(matrix: np.ndarray, pair: np.ndarray, direction: str) -> float:
    return rsum(search_ranks(matrix, pair) if direction == "search" else annotation_ranks(matrix, pair))


def densities(bundle: Bundle, data: SplitData, other: SplitData) -> dict[str, np.ndarray]:
    """The score matrix and the other side's banks of a split (`other`: the collection of the `other` bank)."""
    cal = bundle.calibration
    assert cal is not None
    enc = bundle.text.encode_parsed(data.parsed, data.sentences)
    scores = score_split(bundle, data.feats, enc)
    img = bundle.embed_images(data.feats)
    sent, mask = bundle.embed_sentences(enc)
    ref_sent = cal.calibrate_sentences(cal.ref_sentences, cal.ref_sentence_mask, bundle.blocks)
    ref_img = cal.calibrate_images(cal.ref_images, bundle.blocks)
    vs_ref_sentences = bundle.scores(img, np.ones(img.shape[:2], np.float32), ref_sent, cal.ref_sentence_mask)
    vs_ref_images = bundle.scores(ref_img, np.ones(ref_img.shape[:2], np.float32), sent, mask)
    whole = data.feats[:, 0] / np.maximum(np.linalg.norm(data.feats[:, 0], axis=1, keepdims=True), 1e-12)
    cosine = whole @ whole.T
    np.fill_diagonal(cosine, -np.inf)  # an image is not its own neighbour
    other_enc = bundle.text.encode_parsed(other.parsed, other.sentences)
    return {"scores": scores, "ref_sentences": vs_ref_sentences, "ref_images": vs_ref_images,
            "other_sentences": score_split(bundle, data.feats, other_enc),
            "other_images": score_split(bundle, other.feats, enc),
            "neighbours": np.argsort(-cosine, axis=1, kind="stable")[:, : max(KS_DENSITY)]}


def reranked(m: dict[str, np.ndarray], bank: str, direction: str, k: int, lam: float) -> np.ndarray:
    s = m["scores"]
    if bank == "references" and direction == "search":
        return s - lam * top_mean(m["ref_sentences"], k, 1)[:, None]
    if bank == "references":
        return s - lam * top_mean(m["ref_images"], k, 0)[None, :]
    if bank == "other" and direction == "search":
        return s - lam * top_mean(m["other_sentences"], k, 1)[:, None]
    if bank == "other":
        return s - lam * top_mean(m["other_images"], k, 0)[None, :]
    if bank == "collection-kept" and direction == "search":
        return s - lam * top_mean(s, k, 1)[:, None]
    if bank == "collection-kept":
        return s - lam * top_mean(s, k, 0)[None, :]
    if bank == "neighbours":
        return s + lam * s[m["neighbours"][:, :k]].mean(axis=1)
    if direction == "search":
        return s - lam * top_mean_leaving_out_each_sentence(s, k)
    return s - lam * top_mean_leaving_out_each(s, k)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path(), help="a calibrated model")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature, parse and vector cache")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
    ap.add_argument("--out", type=Path, default=Path("docs/results/rerank-dev.csv"), help="the CSV written")
    args, command = parse_run(ap, argv, "bench.rerank_bench")
    bundle = Bundle.load(args.model)
    train = bundle.meta.get("train", {})
    if bundle.calibration is None or train.get("selection") != "val":
        raise SystemExit(f"{args.model}: needs a calibrated model trained with --selection val (its validation part)")
    parser = make_parser(bundle.text.cfg.parser)
    parts = {"val": held_out_split(load_split(args.data, "train"), int(train["val_images"]), int(train["val_seed"])),
             "dev": load_split(args.data, "dev")}
    mats: dict[str, dict[str, np.ndarray]] = {}
    pairs: dict[str, np.ndarray] = {}
    datas = {}
    for name, split in parts.items():
        datas[name] = load_split_data(args.data, split, bundle.image_cfg, args.cache, parser, args.workers)
        bundle.text.warm(datas[name].parsed, datas[name].sentences, args.cache / "vectors")
    for name, other in (("val", "dev"), ("dev", "val")):
        mats[name], pairs[name] = densities(bundle, datas[name], datas[other]), datas[name].pair_image
    rows: list[dict[str, Any]] = []
    for bank, direction in (("references", "search"), ("references", "annotation"), ("collection", "annotation"),
                            ("collection", "search"), ("other", "annotation"), ("other", "search"),
                            ("collection-kept", "annotation"), ("collection-kept", "search"), ("neighbours", "search")):
        base = {p: direction_rsum(mats[p]["scores"], pairs[p], direction) for p in parts}
        grid = {(0, 0.0): base["val"]}  # no re-rank: chosen when nothing beats it
        grid.update({(k, lam): direction_rsum(reranked(mats["val"], bank, direction, k, lam), pairs["val"], direction)
                     for k, lam in itertools.product(KS_DENSITY, LAMBDAS)})
        (k, lam), val = max(grid.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))  # ties: smaller k, lambda
        dev = (direction_rsum(reranked(mats["dev"], bank, direction, k, lam), pairs["dev"], direction) if lam > 0
               else base["dev"])
        rows.append({"bank": bank, "direction": direction, "k": k, "lambda": lam,
                     "val_before": round(base["val"], 2), "val_after": round(val, 2),
                     "dev_before": round(base["dev"], 2), "dev_after": round(dev, 2),
                     "machine": machine(), "command": command})
        logger.info("%s, %s: k=%d lambda=%.2f: val %.2f -> %.2f, dev %.2f -> %.2f", bank, direction, k, lam,
                    base["val"], val, base["dev"], dev)
    write_rows(args.out, list(rows[0]), rows)


if __name__ == "__main__":
    main()
