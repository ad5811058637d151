"""Can a person trust the relevance scale? Measured once on dev (the scale was fitted on the validation
part of the training data, never on dev):

    python -m bench.relevance_bench --model artifacts/models/full-val-relevance/model.pt

Every dev sentence with its own image (a true pair) and with one other dev image drawn at random (a
random pair), as many of each, the way the scale was fitted. Writes

- docs/results/relevance-dev.csv: the reliability table, per bin of predicted relevance: the pairs in
  it, their mean predicted relevance and the observed share of true pairs (a reliable scale has the
  two equal);
- docs/results/relevance-dev-cutoffs.csv: precision and recall of true pairs at cut-offs 0.1 … 0.9
  (the default, 0.5, marked), and for search as served: the share of dev sentences whose own image is
  the top result and clears the cut-off, and the share whose top result is cut;
- docs/results/relevance-dev.png: the reliability diagram and the two score histograms.
Each CSV row carries the command and the machine.
"""

from __future__ import annotations

import argparse
import csv
import logging
from pathlib import Path

import numpy as np

from bench import machine, parse_run
from model.bundle import Bundle
from model.calibration import DEFAULT_CUTOFF
from model.config import default_artifacts_dir, default_data_dir
from model.dataset import load_split_data
from model.parsers import make_parser
from model.release import served_model_from_env
from training.calibrate import true_and_random_pairs
from training.evaluate import evaluate_scores

logger = logging.getLogger("bench.relevance_bench")
BINS = 10
CUTOFFS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def reliability(pred: np.ndarray, truth: np.ndarray, bins: int = BINS) -> list[dict[str, float]]:
    """Per equal-width bin of predicted relevance: pairs, mean prediction, observed share of true pairs."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(pred, edges[1:-1]), 0, bins - 1)
    rows = []
    for b in range(bins):
        sel = which == b
        n = int(sel.sum())
        rows.append({"bin_low": round(float(edges[b]), 2), "bin_high": round(float(edges[b + 1]), 2), "pairs": n,
                     "predicted": round(float(pred[sel].mean()), 4) if n else float("nan"),
                     "observed": round(float(truth[sel].mean()), 4) if n else float("nan")})
    return rows


def precision_recall(pred: np.ndarray, truth: np.ndarray, cutoff: float) -> tuple[float, float]:
    kept = pred >= cutoff
    tp = float((kept & truth).sum())
    return tp / max(1.0, float(kept.sum())), tp / max(1.0, float(truth.sum()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = default_artifacts_dir()
    ap.add_argument("--model", type=Path, default=served_model_from_env(a),
                    help="a checkpoint with a relevance scale")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--split", default="dev", help="the split measured on")
    ap.add_argument("--cache", type=Path, default=a / "cache", help="the feature, parse and vector cache")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random pairs")
    ap.add_argument("--out", type=Path, default=Path("docs/results/relevance-dev.csv"), help="the table written")
    args, command = parse_run(ap, argv, "bench.relevance_bench")
    bundle = Bundle.load(args.model)
    rel = bundle.relevance
    if rel is None:
        raise SystemExit(f"{args.model} has no relevance scale: python -m training.calibrate --relevance-only")
    data = load_split_data(args.data, args.split, bundle.image_cfg, args.cache, make_parser(bundle.text.cfg.parser))
    bundle.text.warm(data.parsed, data.sentences, args.cache / "vectors")
    _, scores = evaluate_scores(bundle, data)
    true, rand = true_and_random_pairs(scores, data.pair_image, args.seed)
    pred = rel(np.concatenate([true, rand]))
    truth = np.concatenate([np.ones(len(true), bool), np.zeros(len(rand), bool)])
    where = {"machine": machine(), "command": command}

    table = reliability(pred, truth)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*table[0], "machine", "command"])
        w.writeheader()
        w.writerows({**r, **where} for r in table)
    gap = float(np.nansum([r["pairs"] * abs(r["predicted"] - r["observed"]) for r in table]) / len(pred))
    logger.info("reliability (expected calibration error %.4f): %s", gap, table)

    # search as served: each sentence's ranking of all dev images
    top = scores.argmax(axis=0)
    top_rel = rel(scores[top, np.arange(scores.shape[1])])
    own_top = top == data.pair_image
    rows = []
    for c in CUTOFFS:
        p, r = precision_recall(pred, truth, c)
        rows.append({"cutoff": c, "default": c == DEFAULT_CUTOFF, "precision": round(p, 4), "recall": round(r, 4),
                     "search_top1_right_and_kept": round(float((own_top & (top_rel >= c)).mean()), 4),
                     "search_top1_cut": round(float((top_rel < c).mean()), 4),
                     "score_at_cutoff": round(rel.score_at(c), 4), **where})
    cut_path = args.out.with_name(args.out.stem + "-cutoffs.csv")
    with cut_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    logger.info("cut-offs: %s", [{k: v for k, v in r.items() if k not in where} for r in rows])
    plot(table, rel(true), rel(rand), args.out.with_suffix(".png"), gap)
    logger.info("wrote %s, %s and the plot", args.out, cut_path)


def plot(table: list[dict[str, float]], true: np.ndarray, rand: np.ndarray, path: Path, gap: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    filled = [r for r in table if r["pairs"]]
    left.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfectly reliable")
    left.plot([r["predicted"] for r in filled], [r["observed"] for r in filled], marker="o", label="dev")
    left.set_xlabel("predicted relevance (bin mean)")
    left.set_ylabel("observed share of true pairs")
    left.set_title(f"reliability on dev (ECE {gap:.3f})")
    left.legend()
    bins = np.linspace(0, 1, 21)
    right.hist(rand, bins=bins, alpha=0.6, label="random pairs")
    right.hist(true, bins=bins, alpha=0.6, label="true pairs")
    right.axvline(DEFAULT_CUTOFF, color="black", linewidth=1, label=f"default cut-off {DEFAULT_CUTOFF}")
    right.set_xlabel("relevance")
    right.set_ylabel("pairs")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
