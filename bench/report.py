"""Collect trained models into the results table and plots under docs/results.

    python -m bench.report --models artifacts/models --data ../shared/data/flickr8k

For each artifacts/models/<name>/model.pt: evaluates it on the dev split (exact ranks, so every row
is measured the same way), writes docs/results/flickr8k-dev.csv (+ a JSON with every metric, the
Hodosh variant, training times, recall@K and training curves), recall@K curves and training
curves as PNG. With --merge, the rows already in the table whose models are not evaluated now are
kept as they are (and drawn where the JSON holds their curves).

Dev is evaluated here only: the `selection` column says how each row's checkpoint was chosen (on
training images held out of training, a fixed epoch count, or, for older rows, on dev), read from
the run's history.json; each row's variant (model/variants/<name>.toml) is described in the JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench import SplitDataByConfig, add_model_args, kept_rows  # noqa: E402
from fragsearch.model.bundle import Bundle  # noqa: E402
from fragsearch.model.variants import VariantError, load_variant  # noqa: E402
from fragsearch.training.evaluate import annotation_ranks, evaluate, score_split, search_ranks  # noqa: E402

logger = logging.getLogger(__name__)

COLUMNS = ["model", "annot_r1", "annot_r5", "annot_r10", "annot_medr",
           "search_r1", "search_r5", "search_r10", "search_medr", "selection", "command"]
METRICS = COLUMNS[1:9]
# the published numbers the rows are compared with (Karpathy et al. 2014, Table 2): references, not measurements
PAPER_COMMAND = "published: Karpathy et al. 2014, Table 2 (Flickr8K test split, full-size images)"
PAPER_ROWS = {
    "full (paper)": (12.6, 32.9, 44.0, 14.0, 9.7, 29.6, 42.5, 15.0),
    "sdt-rnn (paper)": (6.0, 22.7, 34.0, 23.0, 6.6, 21.6, 31.7, 25.0),
    "devise (paper)": (4.8, 16.5, 27.3, 28.0, 5.9, 20.1, 29.6, 29.0),
}
ORDER = ["full-2x256", "full", "full-crop", "full-roi", "paper", "full (paper)", "fragment+global", "fragment",
         "global", "fullframe", "bow", "bigram", "sentence", "large-regions", "large-regions+mlp", "contextual",
         "contextual-r25", "wide",
         "dropout", "two-branch", "dt-rnn", "sdt-rnn", "sdt-rnn (paper)", "dt-rnn-contextual", "sdt-rnn-contextual",
         "devise", "devise (paper)", "devise-bidirectional", "devise-contextual",
         "full-val", "full-maxviol", "full-fragdrop", "full-long", "full-merge2", "full-merge3", "full-merge6",
         "full-ft", "full-merge3-blocks", "full-merge6-blocks", "full-lite2", "full-val-q7", "full-mirror",
         "full-mirror-merge2", "full-val-q7-seed1", "full-h256", "full-h256-seed1", "full-h256-merge2", "full-nce",
         "full-global-mlp", "full-q7-merge4", "full-q7", "full-4x128", "full-ft-q7", "full-ft-q7-cnn1e-5", "full-lite1",
         "release-full-2x256", "full-dettop-2x256", "full-detcls-2x256", "full-detcls-lite1-2x256",
         "full-lite1-2x256"]


def selection_label(hist: dict[str, Any]) -> str:
    """How a run's checkpoint was chosen, from its history.json (older runs: dev or fixed epochs)."""
    history = hist.get("history", [])
    sel = hist.get("selection")
    if sel is not None:
        if sel["rule"] == "val" and "finetune" in hist:  # training/finetune.py: epoch 0 is the init model
            return (f"val ({sel['images']} train images held out): fine-tuning epoch {sel['epoch']}/"
                    f"{hist['finetune']['epochs']} after the init run")
        if sel["rule"] == "val":
            return f"val ({sel['images']} train images held out): epoch {sel['epoch']}/{sel['epochs']}"
        if hist.get("members"):  # a merge of runs selected "last": the merge itself has no epochs
            epochs = sorted(set(hist.get("member_epochs", [])))
            each = f"fixed {epochs[0]} epochs" if len(epochs) == 1 else "its last epoch"
            return f"merge of {len(hist['members'])} members, each {each}"
        return f"fixed {sel['epochs']} epochs"
    if not history:
        return "dev (best evaluated epoch; history not kept)"
    best = hist.get("best")
    return f"dev: epoch {int(best['epoch'])}/{len(history)}" if best else f"fixed {len(history)} epochs"


def variant_description(hist: dict[str, Any], name: str) -> str | None:
    """The description of the variant the run names (None when its file is gone)."""
    try:
        return load_variant(str(hist.get("variant", name))).description
    except VariantError:
        return None


def _style(i: int, name: str) -> dict[str, Any]:
    """A distinct colour per row (tab20), the served model and the reference drawn heavier."""
    return {"color": plt.get_cmap("tab20")(i % 20), "linewidth": 2.4 if name in ("full-2x256", "two-branch") else 1.2,
            "linestyle": "--" if name == "two-branch" else "-"}


VAL_COLUMNS = ["model", "images", "rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10",
               "epoch", "command"]


def write_val_table(path: Path, models: Path, names: list[str], merge: bool, order: Any) -> None:
    """The validation part's numbers each row was selected on (its history's best epoch: no evaluation
    here), for the rows of `names` trained with --selection val; with `merge` the other rows already in the
    file stay."""
    rows: list[dict[str, Any]] = list(kept_rows(path, merge, names))
    for name in names:
        hist_path = models / name / "history.json"
        hist = json.loads(hist_path.read_text()) if hist_path.is_file() else {}
        best, sel = hist.get("best"), hist.get("selection") or {}
        if not best or sel.get("rule") != "val":
            continue
        rows.append({"model": name, "images": sel.get("images"), "epoch": int(best.get("epoch", 0)),
                     **{c: round(float(best[c]), 1) for c in VAL_COLUMNS[2:9]}, "command": hist.get("command", "")})
    rows.sort(key=lambda r: order(r["model"]))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=VAL_COLUMNS)
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, Path("docs/results"))
    ap.add_argument("--only", nargs="*", default=None, help="model names to include")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = [p.parent.name for p in sorted(args.models.glob("*/model.pt"))]
    if args.only:
        names = [n for n in names if n in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = args.out / f"flickr8k-{args.split}.csv", args.out / f"flickr8k-{args.split}.json"
    rows: list[dict[str, Any]] = list(kept_rows(csv_path, args.merge, [*names, *PAPER_ROWS]))
    old = json.loads(json_path.read_text()) if rows and json_path.is_file() else {}
    details: dict[str, Any] = {r["model"]: old[r["model"]] for r in rows if r["model"] in old}
    curves: dict[str, tuple[list[float], list[float]]] = {
        n: (d["recall_at_k"]["annot"], d["recall_at_k"]["search"]) for n, d in details.items() if "recall_at_k" in d}
    histories: dict[str, list[dict[str, float]]] = {n: d["history"] for n, d in details.items() if "history" in d}
    split_data = SplitDataByConfig(args.data, args.split, args.cache)
    for name in names:
        bundle = Bundle.load(args.models / name / "model.pt")
        data = split_data.get(bundle)
        m = evaluate(bundle, data)  # type: ignore[arg-type]
        enc = bundle.text.encode_parsed(data.parsed, data.sentences)  # type: ignore[attr-defined]
        start = time.perf_counter()
        scores = score_split(bundle, data.feats, enc)  # type: ignore[attr-defined]
        score_seconds = time.perf_counter() - start  # every image against every sentence, exact S_kl
        ks = np.arange(1, 51)
        a_r = annotation_ranks(scores, data.pair_image)  # type: ignore[attr-defined]
        s_r = search_ranks(scores, data.pair_image)  # type: ignore[attr-defined]
        curves[name] = ([100 * float(np.mean(a_r <= k)) for k in ks], [100 * float(np.mean(s_r <= k)) for k in ks])
        hist_path = args.models / name / "history.json"
        hist = json.loads(hist_path.read_text()) if hist_path.is_file() else {}
        histories[name] = hist.get("history", [])
        command = hist.get("command", "")
        rows.append({"model": name, **{c: round(m[c], 1) for c in METRICS}, "selection": selection_label(hist),
                     "command": command})
        details[name] = {"metrics": m, "train_seconds": hist.get("train_seconds"),
                         "variant": hist.get("variant", name), "description": variant_description(hist, name),
                         "selection": hist.get("selection", rows[-1]["selection"]),
                         "epoch_seconds": [h.get("seconds") for h in hist.get("history", [])],
                         "config": hist.get("config"), "command": command,
                         "recall_at_k": {"annot": curves[name][0], "search": curves[name][1]},
                         "history": histories[name],
                         "cost": {"h": int(bundle.cfg.h), "score_seconds": round(score_seconds, 1),
                                  "pairs": int(scores.shape[0] * scores.shape[1])}}
        logger.info("%s: %s", name, json.dumps(rows[-1]))

    def order(name: str) -> tuple[int, str]:
        return (ORDER.index(name) if name in ORDER else len(ORDER), name)

    rows += [{"model": name, **dict(zip(METRICS, values, strict=True)), "selection": "published",
              "command": PAPER_COMMAND}
             for name, values in PAPER_ROWS.items()]
    rows.sort(key=lambda r: order(r["model"]))
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    json_path.write_text(json.dumps({n: details[n] for n in sorted(details, key=order) if n not in PAPER_ROWS},
                                    indent=2))
    every = [p.parent.name for p in sorted(args.models.glob("*/model.pt")) if p.parent.name in ORDER]
    write_val_table(args.out / "flickr8k-val.csv", args.models, every, args.merge, order)
    curves = {n: curves[n] for n in sorted(curves, key=order)}
    histories = {n: histories[n] for n in sorted(histories, key=order)}

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, (ann, sea)) in enumerate(curves.items()):
        axes[0].plot(range(1, 51), ann, label=name, **_style(i, name))
        axes[1].plot(range(1, 51), sea, label=name, **_style(i, name))
    for ax, title in zip(axes, ("image annotation (image -> sentences)", "image search (sentence -> images)"),
                         strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("K")
        ax.set_ylabel("recall@K (%)")
        ax.set_title(f"Flickr8K {args.split} (224 px copy): {title}")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / f"recall-at-k-{args.split}.png", dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, hist) in enumerate(histories.items()):
        trained = [h for h in hist if "loss" in h]  # a fine-tuning run's epoch 0, a merge: evaluated only
        axes[0].plot([h["epoch"] for h in trained], [h["loss"] for h in trained], label=name, **_style(i, name))
        ev = [(h["epoch"], h.get("val_rsum", h.get("rsum"))) for h in hist if "val_rsum" in h or "rsum" in h]
        if ev:
            axes[1].plot(*zip(*ev, strict=True), marker="o", label=name, **_style(i, name))
    axes[0].set(xlabel="epoch", ylabel="training loss", title="training loss", yscale="log")
    axes[1].set(xlabel="epoch", ylabel="R-sum (R@1+5+10, both directions)",
                title="R-sum on the selection split (held-out training images; dev for older rows)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "training-curves.png", dpi=110)
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
