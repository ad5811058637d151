"""How often an alignment points at the right thing: a pointing game on nouns ImageNet can verify.

    python -m bench.alignment --only full full-roi=artifacts/alignment/models/full-roi/model.pt

No model was tuned to this measure. For every dev caption and its own image, the alignment the
service shows is computed by the service's code (`index.matches.matches` →
`model.score.align`: each
sentence fragment's best image fragment by v_i · s_j; fragments with no positive score are not shown
and not counted). A **trial** is a shown triplet that names a noun of `bench/imagenet_nouns.json`
(dog, horse, bicycle, ball, …: each noun's ImageNet-1k classes are the WordNet hyponyms of one sense,
see tools/imagenet_nouns.py). It is a **hit** when the backbone's own ImageNet-1k classifier
(EfficientNet-Lite0 and its head, float, on the region cropped and warped to 224²) ranks one of that
noun's classes in its top 5 (`top5`) or first (`top1`) for the image fragment the triplet aligns to.
A triplet naming two such nouns (`prep_with(dog, ball)`) is one trial, a hit if either is verified.

On the same trials:

- `random`: the expected hit rate of a fragment drawn uniformly from the 20 the model chooses from
  (the whole image and the 19 regions), computed exactly rather than sampled;
- `largest`: the largest of the 19 regions (by area);
- `whole`: the whole-image fragment (row 0);
- `any`: some fragment of the 20 is verified (the ceiling for any choice among them).

Calibration divides all of an image's fragments by one scale and all of a sentence's by another, so
it cannot change which region a triplet aligns to: the `calibrated` = no row checks that it does not.
`sentence_on_whole` is the share of dev sentences whose whole-sentence fragment aligns to the
whole-image fragment (the page draws that fragment as a frame label, not as a region).

Writes docs/results/alignment-dev.csv (one row per model and calibration), alignment-dev-nouns.csv
(per noun) and alignment-dev.png. The classifier's predictions are cached per set of boxes under
<artifacts>/alignment/.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import logging
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from bench import SplitDataByConfig, add_model_args, kept_rows, made_backbone
from fragsearch.index.matches import matches
from fragsearch.model.backbone import Backbone
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData
from fragsearch.model.embed import embed_encoded
from fragsearch.model.fragments import SENTENCE_REL
from fragsearch.model.image import region_crops
from fragsearch.model.imageio import load_image
from fragsearch.model.onnx import set_threads
from fragsearch.settings import default_artifacts_dir

if TYPE_CHECKING:
    from fragsearch.training.nets.backbone import TorchBackbone

logger = logging.getLogger(__name__)

NOUNS_FILE = Path(__file__).resolve().parent / "imagenet_nouns.json"
TOP_K = 5  # predictions kept per region (top-5 hits; top-1 is the first of them)
CLASSIFIER_SIZE = 224  # the side each region is warped to for the classifier (the backbone's own size)
BASELINES = ("random", "largest", "whole", "any")
KS = (1, 5)


class NounClasses:
    """Caption words → nouns → the ImageNet-1k classes that verify them (bench/imagenet_nouns.json)."""

    def __init__(self, nouns: dict[str, frozenset[int]], words: dict[str, str]) -> None:
        self.classes = nouns
        self._noun_of = words

    @classmethod
    def load(cls, path: Path = NOUNS_FILE) -> NounClasses:
        data = json.loads(Path(path).read_text())
        nouns: dict[str, frozenset[int]] = {}
        words: dict[str, str] = {}
        for entry in data["nouns"]:
            nouns[entry["noun"]] = frozenset(int(c) for c in entry["classes"])
            for w in entry["words"]:
                if words.setdefault(w, entry["noun"]) != entry["noun"]:
                    raise ValueError(f"{path}: the word {w!r} is listed for two nouns")
        return cls(nouns, words)

    def noun_of(self, word: str) -> str | None:
        """The noun a caption word (lower-case, as in a triplet) names, or None."""
        return self._noun_of.get(word)

    def nouns_in(self, words: Sequence[str]) -> tuple[str, ...]:
        """The verifiable nouns among a triplet's words, each once, in order."""
        found = [n for n in (self.noun_of(w) for w in words) if n is not None]
        return tuple(dict.fromkeys(found))

    def targets(self, nouns: Sequence[str]) -> frozenset[int]:
        """The classes that verify any of these nouns."""
        return frozenset().union(*(self.classes[n] for n in nouns))


@dataclass(frozen=True)
class Trial:
    """One shown triplet naming verifiable nouns: its image, the fragment it aligns to, the nouns."""

    image: int
    fragment: int
    nouns: tuple[str, ...]


def verified(top: np.ndarray, trials: Sequence[Trial], nouns: NounClasses, k: int) -> np.ndarray:
    """(T, F) bool: for each trial, which fragments of its image have one of its nouns' classes among
    their top-k predictions. top: (N, F, >= k) class ids per image and fragment, best first."""
    out = np.zeros((len(trials), top.shape[1]), dtype=bool)
    for t, trial in enumerate(trials):
        wanted = np.fromiter(nouns.targets(trial.nouns), dtype=np.int64)
        out[t] = np.isin(top[trial.image, :, :k], wanted).any(axis=1)
    return out


def largest_region(boxes: np.ndarray) -> int:
    """The index of the largest region (by area) among fragments 1.. of boxes (F, 4); the first on ties."""
    area = (boxes[1:, 2] - boxes[1:, 0]) * (boxes[1:, 3] - boxes[1:, 1])
    return 1 + int(np.argmax(area))


def pointing_rates(ok: np.ndarray, chosen: np.ndarray, largest: np.ndarray) -> dict[str, float]:
    """Hit rates of the model and the baselines over trials.

    ok: (T, F) verified fragments of each trial's image; chosen: (T,) the fragment the model aligned
    each trial to; largest: (T,) the largest region of each trial's image."""
    if not len(ok):
        return {"model": math.nan, **{b: math.nan for b in BASELINES}}
    rows = np.arange(len(ok))
    return {"model": float(ok[rows, chosen].mean()), "random": float(ok.mean()),
            "largest": float(ok[rows, largest].mean()), "whole": float(ok[:, 0].mean()),
            "any": float(ok.any(axis=1).mean())}


def wilson95(p: float, n: int) -> tuple[float, float]:
    """Wilson's 95 % score interval (low, high) of a rate p observed over n trials. Unlike the normal
    approximation (Wald: p ± 1.96·sqrt(p(1-p)/n)) it stays inside [0, 1] and does not shrink to nothing
    at 0 % or 100 %, which the per-noun rates over a few trials reach."""
    if not n:
        return math.nan, math.nan
    z2 = 1.96**2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = 1.96 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


# -- the classifier on the regions ------------------------------------------------------------------


def top_classes(logits: np.ndarray, k: int) -> np.ndarray:
    """(N, 1000) logits -> (N, k) class ids of the k largest, best first (the softmax's order; a tie goes
    to the lower class id)."""
    return np.argsort(-np.asarray(logits, np.float32), axis=1, kind="stable")[:, :k]


def classifier(runtime: str) -> Backbone | TorchBackbone:
    """The float backbone with its ImageNet head on the CPU: the runtime's graph on ONNX Runtime (auto,
    onnx), or torch eager (torch: the trainer's, training/nets/backbone.py)."""
    if runtime == "torch":
        from fragsearch.training.nets.backbone import TorchBackbone

        return TorchBackbone("cpu")
    return made_backbone("fp32", runtime)


def region_predictions(data: SplitData, cache_dir: Path, runtime: str = "auto") -> np.ndarray:
    """(N, F, TOP_K) ImageNet-1k class ids, best first, of every fragment box of every image of the
    split: the float backbone and its head on the box cropped and warped to 224². Cached by boxes."""
    digest = hashlib.sha1(json.dumps([list(data.names), CLASSIFIER_SIZE, TOP_K]).encode())
    digest.update(np.ascontiguousarray(data.boxes, dtype=np.float32).tobytes())
    path = cache_dir / f"predictions-{digest.hexdigest()[:16]}.npz"
    if path.is_file():
        with np.load(path) as z:
            logger.info("region predictions from %s", path)
            return np.asarray(z["top"])
    backbone = classifier(runtime)
    top = np.zeros((*data.boxes.shape[:2], TOP_K), dtype=np.int16)
    for k, name in enumerate(tqdm(data.names, desc="classifying regions", unit="img")):
        image = load_image(data.split.image_path(name))
        logits = backbone.classify(backbone.pooled(region_crops(image, data.boxes[k], CLASSIFIER_SIZE)))
        top[k] = top_classes(logits, TOP_K)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp.npz")
    np.savez(tmp, top=top)
    tmp.replace(path)
    return top


# -- the model's alignments ---------------------------------------------------------------------------


@dataclass
class Alignments:
    """The trials of one model on a split, and where its whole-sentence fragments point."""

    trials: list[Trial]
    sentence_fragments: int  # shown whole-sentence fragments
    sentence_on_whole: int  # ... aligned to the whole-image fragment
    region_trials: list[Trial] = dataclasses.field(default_factory=list)  # aligned among the 19 regions only


def model_alignments(bundle: Bundle, data: SplitData, nouns: NounClasses, calibrated: bool,
                     cache: Path) -> Alignments:
    """Every dev caption against its own image, aligned as the service aligns a result."""
    bundle.text.warm(data.parsed, data.sentences, cache / "vectors")
    enc = bundle.text.encode_parsed(data.parsed, data.sentences)
    sents = embed_encoded(bundle, enc, calibrated=calibrated)
    img = bundle.embed_images(data.feats, calibrated=calibrated)
    out = Alignments([], 0, 0)
    for li, (frags, triplets) in enumerate(tqdm(sents, desc="aligning", unit="sent")):
        if not len(frags):
            continue
        k = int(data.pair_image[li])
        for m in matches(img[k], frags, triplets, data.boxes[k], bundle.blocks):
            if m.relation == SENTENCE_REL:
                out.sentence_fragments += 1
                out.sentence_on_whole += int(m.fragment == 0)
                continue
            found = nouns.nouns_in(m.words)
            if found:
                out.trials.append(Trial(k, m.fragment, found))
        for m in matches(img[k][1:], frags, triplets, data.boxes[k][1:], bundle.blocks):  # the regions the page draws
            found = nouns.nouns_in(m.words)
            if found and m.relation != SENTENCE_REL:
                out.region_trials.append(Trial(k, m.fragment + 1, found))
    return out


def extra_rates(al: Alignments, top: np.ndarray, nouns: NounClasses, skip: str = "dog") -> dict[str, Any]:
    """The model's pointing with the whole-image fragment excluded (aligned among the 19 regions only;
    `random` = a region drawn uniformly), and on the trials naming none of `skip` (the dominant noun)."""
    row: dict[str, Any] = {}
    parts = {"regions": al.region_trials, "nondog": [t for t in al.trials if skip not in t.nouns],
             "nondog_regions": [t for t in al.region_trials if skip not in t.nouns]}
    for part, trials in parts.items():
        row[f"{part}_trials"] = len(trials)
        chosen = np.asarray([t.fragment for t in trials], dtype=np.int64)
        for k in KS:
            ok = verified(top, trials, nouns, k)
            hit = float(ok[np.arange(len(ok)), chosen].mean()) if len(ok) else math.nan
            row[f"{part}_model_top{k}"] = round(100 * hit, 1)
            pool = ok[:, 1:] if part.endswith("regions") else ok
            row[f"{part}_random_top{k}"] = round(100 * float(pool.mean()), 1) if len(ok) else math.nan
    return row


def rates_row(trials: Sequence[Trial], top: np.ndarray, boxes: np.ndarray, nouns: NounClasses) -> dict[str, Any]:
    """The rates of the model and each baseline at top-1 and top-5 over these trials (%, one decimal)."""
    chosen = np.asarray([t.fragment for t in trials], dtype=np.int64)
    largest = np.asarray([largest_region(boxes[t.image]) for t in trials], dtype=np.int64)
    row: dict[str, Any] = {"trials": len(trials)}
    for k in KS:
        r = pointing_rates(verified(top, trials, nouns, k), chosen, largest)
        row[f"model_top{k}"] = round(100 * r["model"], 1)
        low, high = wilson95(r["model"], len(trials))
        row[f"model_top{k}_low95"], row[f"model_top{k}_high95"] = round(100 * low, 1), round(100 * high, 1)
        for b in BASELINES:
            row[f"{b}_top{k}"] = round(100 * r[b], 1)
    row["on_whole"] = round(100 * float(np.mean(chosen == 0)), 1) if len(trials) else math.nan
    return row


FIELDS = ["model", "region_features", "backbone_precision", "calibrated", "trials", "images",
          *[f for k in KS for f in (f"model_top{k}", f"model_top{k}_low95", f"model_top{k}_high95",
                                    *[f"{b}_top{k}" for b in BASELINES])],
          "on_whole", "sentence_on_whole",
          *[f"{part}_{f}" for part in ("regions", "nondog", "nondog_regions")
            for f in ("trials", *[f"{w}_top{k}" for k in KS for w in ("model", "random")])],
          "command"]
NOUN_FIELDS = ["model", "noun", "trials", "model_top5", "model_top5_low95", "model_top5_high95", "random_top5",
               "largest_top5", "whole_top5", "any_top5", "model_top1", "model_top1_low95", "model_top1_high95",
               "random_top1", "largest_top1", "whole_top1", "any_top1"]


def model_paths(specs: Sequence[str], models: Path) -> list[tuple[str, Path]]:
    """`name` → models/name/model.pt; `name=path` → that checkpoint."""
    out = []
    for spec in specs:
        name, _, path = spec.partition("=")
        out.append((name, Path(path) if path else models / name / "model.pt"))
    return out


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["calibrated"] != "no"]
    labels = {"random": "random fragment", "largest": "largest region", "whole": "whole image",
              "any": "any fragment (ceiling)"}
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.28 * max(len(shown), 1)))  # one bar per row, however many
    ys = np.arange(len(shown))[::-1]
    ax.barh(ys, [float(r["model_top5"]) for r in shown], 0.7, color="tab:blue", label="aligned region")
    ax.errorbar([float(r["model_top5"]) for r in shown], ys,
                xerr=[[float(r["model_top5"]) - float(r["model_top5_low95"]) for r in shown],
                      [float(r["model_top5_high95"]) - float(r["model_top5"]) for r in shown]],
                fmt="none", ecolor="black", capsize=2, lw=0.8)
    colours = {"random": "white", "largest": "tab:orange", "whole": "tab:green", "any": "tab:red"}
    for b, marker in zip(BASELINES, "os^D", strict=True):
        ax.scatter([float(r[f"{b}_top5"]) for r in shown], ys, marker=marker, s=16, zorder=3, label=labels[b],
                   c=colours[b], edgecolors="black", linewidths=0.4)
    ax.set_yticks(ys, [f"{r['model']} ({r['trials']})" for r in shown], fontsize=7)
    ax.set_xlabel("noun verified in top-5 (%): the triplet's aligned region (bar, 95 % interval) and baselines")
    ax.set_title("Pointing game on Flickr8K dev", fontsize=9)
    ax.legend(fontsize=7, loc="lower left", ncols=5, bbox_to_anchor=(0, 1.02), frameon=False)
    ax.set_xlim(0, 100)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, Path("docs/results/alignment-dev.csv"))
    ap.add_argument("--only", nargs="+", required=True, help="model names under --models, or name=checkpoint")
    ap.add_argument("--nouns", type=Path, default=NOUNS_FILE, help="noun -> ImageNet classes (tools/imagenet_nouns.py)")
    ap.add_argument("--work", type=Path, default=default_artifacts_dir() / "alignment",
                    help="where the region predictions are cached")
    ap.add_argument("--runtime", choices=("auto", "torch", "onnx"), default="auto",
                    help="how the float classifier runs (auto, onnx: ONNX Runtime, equal to torch to ~1e-5; torch: "
                         "torch eager)")
    ap.add_argument("--threads", type=int, default=2, help="torch / ONNX Runtime threads")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_threads(args.threads)
    command = "python -m bench.alignment " + shlex.join(a for a in (argv if argv is not None else sys.argv[1:]))
    nouns = NounClasses.load(args.nouns)
    specs = model_paths(args.only, args.models)
    rows: list[dict[str, Any]] = [with_wilson(r) for r in kept_rows(args.out, args.merge, [n for n, _ in specs])]
    nouns_out = args.out.with_name(args.out.stem + "-nouns.csv")
    noun_rows: list[dict[str, Any]] = [with_wilson(r) for r in kept_rows(nouns_out, args.merge, [n for n, _ in specs])]
    split_data = SplitDataByConfig(args.data, args.split, args.cache)
    for name, path in specs:
        bundle = Bundle.load(path)
        if bundle.cfg.kind != "fragment" or bundle.image_cfg.full_frame_only:
            logger.info("%s: not a fragment model with regions, skipped", name)
            continue
        data = split_data.get(bundle)
        top = region_predictions(data, args.work, args.runtime)
        for calibrated in ([True, False] if bundle.calibration is not None else [False]):
            al = model_alignments(bundle, data, nouns, calibrated, args.cache)
            row = {"model": name, "region_features": bundle.image_cfg.region_features,
                   "backbone_precision": bundle.image_cfg.backbone_precision,
                   "calibrated": "yes" if calibrated else "no", "images": len(data.names),
                   **rates_row(al.trials, top, data.boxes, nouns),
                   "sentence_on_whole": round(100 * al.sentence_on_whole / al.sentence_fragments, 1)
                   if al.sentence_fragments else "", **extra_rates(al, top, nouns), "command": command}
            logger.info("%s: %s", name, {k: v for k, v in row.items() if k != "command"})
            rows.append(row)
            if calibrated == (bundle.calibration is not None):  # per noun: the model as served
                for noun in nouns.classes:
                    sub = [t for t in al.trials if noun in t.nouns]
                    if sub:
                        r = rates_row(sub, top, data.boxes, nouns)
                        noun_rows.append({"model": name, "noun": noun, **{f: r[f] for f in NOUN_FIELDS[2:]}})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, FIELDS, rows)
    write_csv(nouns_out, NOUN_FIELDS, noun_rows)
    plot(rows, args.out.with_suffix(".png"))
    logger.info("wrote %s", args.out)


def with_wilson(row: dict[str, Any]) -> dict[str, Any]:
    """A kept row written before the Wilson bounds: its Wald half-width dropped, the bounds computed from
    its rate and trial count (the rate is rounded to 0.1 %, the bounds move by less than that)."""
    out = {k: v for k, v in row.items() if not k.endswith("_ci95")}
    for k in KS:
        if out.get(f"model_top{k}") not in (None, "") and not out.get(f"model_top{k}_low95"):
            low, high = wilson95(float(out[f"model_top{k}"]) / 100, int(out["trials"]))
            out[f"model_top{k}_low95"], out[f"model_top{k}_high95"] = round(100 * low, 1), round(100 * high, 1)
    return out


def write_csv(path: Path, fields: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
