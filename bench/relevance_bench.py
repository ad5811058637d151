"""Can a person trust the relevance scale? Measured on dev (the scale is fitted on the validation part of
the training data, never on dev), for a model and, side by side, a baseline (another model, or another
scale of the same score; each is measured on its own scores):

    python -m bench.relevance_bench --model model/released/model.json [--baseline OTHER/model.json]

What a match is, on dev (`--proxy`): the sentence's own image, another image one of whose captions says what the
sentence says (training.relevance.described_alike), or (`named`, the default, the rule a scale with phrase
evidence is fitted with: training/evidence.py `named_alike`) an image whose captions and Entities phrases name
every thing the sentence names. The pairs judged are
the ones searches show: the 10 best images of every dev caption in the 1,000 dev images, and the 10 best
captions of every dev image among the 5,000, each with the relevance the service gives it for that
collection. Writes

- docs/results/relevance-dev.csv: the reliability table: per bin of predicted relevance, per model and
  direction, the pairs in it, their mean relevance and the observed share of matches;
- docs/results/relevance-dev-no-good-match.csv: per model and case, how often the default cut-off answers
  "no good match": every dev caption with its own image taken out of the collection (all of them, and those
  whose best remaining image is no match), captions of training images about an object no dev caption names
  (a noun found in no dev caption), and the share of true pairs that still clear the cut-off;
- docs/results/relevance-dev.json: the summary (expected calibration error, precision of the pairs shown
  at relevance >= 0.5, the shares above, and the best image of a few searches for what dev does not hold,
  `EXAMPLES`, with its relevance) and docs/results/relevance-dev.png: the reliability diagram.
Each row carries the command and the machine.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine, parse_run
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import DEFAULT_CUTOFF, RELEVANCE_TOP, Relevance
from fragsearch.model.data import load_split
from fragsearch.model.dataset import SplitData, load_split_data
from fragsearch.model.embed import embed_texts
from fragsearch.model.evidence import PhraseEvidence
from fragsearch.model.parsers import make_parser
from fragsearch.settings import default_artifacts_dir, default_data_dir, default_model_path
from fragsearch.training.evaluate import evaluate_scores, score_split
from fragsearch.training.evidence import pair_terms
from fragsearch.training.relevance import Shown, best_of, calibration_error, matches_of, reliability, shown

logger = logging.getLogger("bench.relevance_bench")
SHOWN = 10  # results of each query judged
# searches a new user tries for what dev does not hold: each one's best image and its relevance are reported
EXAMPLES = ("a laptop on a wooden desk", "a plate of spaghetti with tomato sauce",
            "a red sports car parked in a garage")
ABSENT_SENTENCES = 500  # training captions about an object no dev caption names
NOUN_LABELS = ("nsubj", "dobj", "obj", "pobj", "conj", "compound")  # where a caption's objects sit in its tree


def absent_object_captions(train: Any, dev: SplitData, parser: Any, seed: int) -> tuple[list[str], list[str]]:
    """Up to `ABSENT_SENTENCES` training captions naming an object (a noun of the parse: a subject, object
    or prepositional object) that occurs in no dev caption in any form, and the nouns they name."""
    dev_words = {t for p in dev.parsed for t in p.tokens}

    def known(word: str) -> bool:
        return any(form in dev_words for form in (word, word + "s", word + "es", word.rstrip("s")))

    captions = [c for caps in train.captions for c in caps]
    counts = Counter(w for c in captions for w in re.findall(r"[a-z]+", c.lower()))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(captions))
    picked: list[str] = []
    nouns: list[str] = []
    for start in range(0, len(order), 2000):
        chunk = [captions[i] for i in order[start : start + 2000]]
        candidates = [c for c in chunk if any(not known(w) and counts[w] >= 3 and len(w) > 2
                                              for w in re.findall(r"[a-z]+", c.lower()))]
        for text, parsed in zip(candidates, parser.parse(candidates), strict=True):
            absent = [t for t, lab in zip(parsed.tokens, parsed.labels, strict=False)
                      if (lab in NOUN_LABELS or lab.startswith("prep")) and t.isalpha() and len(t) > 2
                      and not known(t) and counts[t] >= 3]
            if absent:
                picked.append(text)
                nouns.append(absent[0])
            if len(picked) >= ABSENT_SENTENCES:
                return picked, nouns
    return picked, nouns


Terms = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (captions, images) -> (n, 2) phrase evidence terms


def with_terms(part: Shown, terms: Terms | None) -> Shown:
    """The pairs with their phrase evidence terms, where the scale reads them (`terms`: None where it does not)."""
    if terms is None or part.caption is None or part.image is None:
        return part
    return dataclasses.replace(part, evidence=terms(part.caption, part.image))


def measure(rel: Relevance, scores: np.ndarray, matches: np.ndarray, pair_image: np.ndarray,
            absent: np.ndarray, terms: Terms | None = None, absent_terms: Terms | None = None
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The summary and the reliability rows of one scale on dev's score matrix (each result's relevance for
    its query in the collection searched; with `terms`, the phrase evidence of each pair, as served)."""
    n, n_sent = scores.shape
    out: dict[str, Any] = {"scale": rel.to_state()}
    rows: list[dict[str, Any]] = []
    preds, truths = [], []
    images, captions = np.arange(n), np.arange(n_sent)
    for side, part in (("search", shown(scores.T, matches.T, True, SHOWN, rows=captions, cols=images)),
                       ("annotate", shown(scores, matches, False, SHOWN, rows=images, cols=captions))):
        part = with_terms(part, terms)
        y, p = part.match, part.relevance(rel)
        table = reliability(p, y)
        rows += [{"direction": side, **r} for r in table]
        at = p >= DEFAULT_CUTOFF
        out[side] = {"pairs": int(len(p)), "match_share": round(float(y.mean()), 4),
                     "ece": round(calibration_error(table), 4),
                     "shown_at_cutoff": int(at.sum()),
                     "precision_at_cutoff": round(float(y[at].mean()), 4) if at.any() else None,
                     "mean_relevance_at_cutoff": round(float(p[at].mean()), 4) if at.any() else None}
        preds.append(p)
        truths.append(y)
    both = reliability(np.concatenate(preds), np.concatenate(truths))
    rows += [{"direction": "both", **r} for r in both]
    out["ece_both"] = round(calibration_error(both), 4)
    cols = np.arange(n_sent)
    true = Shown(scores[pair_image, cols].astype(np.float64), np.ones(n_sent, bool), np.ones(n_sent, bool), cols,
                 best_of(scores.T.astype(np.float64), RELEVANCE_TOP + 1), np.full(n_sent, n), cols,
                 np.asarray(pair_image))
    true_rel = with_terms(true, terms).relevance(rel)
    rest = scores.copy()
    rest[pair_image, cols] = -np.inf
    # the best remaining image, in the collection without the own one
    gone = with_terms(shown(rest.T, matches.T, True, 1, rows=captions, cols=images), terms)
    best_rel, best_match = gone.relevance(rel), gone.match
    absent_best = (with_terms(shown(absent.T, np.zeros(absent.T.shape, bool), True, 1,
                                    rows=np.arange(absent.shape[1]), cols=images), absent_terms).relevance(rel)
                   if absent.size else np.zeros(0))
    out["no_good_match"] = {
        "own_image_removed": round(float((best_rel < DEFAULT_CUTOFF).mean()), 4),
        "own_image_removed_best_no_match": round(float((best_rel[~best_match] < DEFAULT_CUTOFF).mean()), 4),
        "own_image_removed_best_is_match_kept": round(float((best_rel[best_match] >= DEFAULT_CUTOFF).mean()), 4)
        if best_match.any() else None,
        "absent_object": round(float((absent_best < DEFAULT_CUTOFF).mean()), 4) if absent.size else None,
        "true_pairs_clearing": round(float((true_rel >= DEFAULT_CUTOFF).mean()), 4),
        "best_remaining_median_relevance": round(float(np.median(best_rel)), 4),
        "best_remaining_is_match": round(float(best_match.mean()), 4),
    }
    return out, rows


def text_terms(bundle: Bundle, scale: PhraseEvidence, data: SplitData, texts: list[str]) -> Terms:
    """The phrase evidence terms of (text, image) pairs: `texts` (not the split's captions) in `data`'s images."""
    embedded = embed_texts(bundle, texts, strict=False)

    def terms(which: np.ndarray, image_ids: np.ndarray) -> np.ndarray:
        out = np.zeros((len(which), 2))
        for n, (t, k) in enumerate(zip(which.tolist(), image_ids.tolist(), strict=True)):
            sent, triplets = embedded[t]
            if len(sent):
                img = bundle.embed_images(data.feats[k : k + 1])[0]
                out[n] = scale.for_sentence(sent, triplets).found(img).terms()
        return out

    return terms


def best_images(bundle: Bundle, data: SplitData, sentences: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each sentence's best image in the split's collection, its score, the next image's and its relevance
    there (what a search with the default cut-off shows or withholds)."""
    rel = bundle.relevance
    assert rel is not None
    scores = score_split(bundle, data.feats, bundle.text.encode(list(sentences), strict=False))
    evidence = bundle.evidence if rel.uses_evidence else None
    terms = None if evidence is None else text_terms(bundle, evidence, data, list(sentences))
    out = []
    for j, sentence in enumerate(sentences):
        col = scores[:, j]
        first, second = np.lexsort((np.arange(len(col)), -col))[:2]
        scale = rel.for_query("search", col, len(col))
        found = None if terms is None else terms(np.asarray([j]), np.asarray([first]))[0]
        out.append({"sentence": sentence, "best": data.names[first], "score": round(float(col[first]), 4),
                    "next_score": round(float(col[second]), 4),
                    "relevance": round(scale.of(float(col[first]), found), 4)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = default_artifacts_dir()
    ap.add_argument("--model", type=Path, default=default_model_path(), help="a model with a relevance scale")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another model (or the same score with another relevance scale), measured beside it")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--split", default="dev", help="the split measured on")
    ap.add_argument("--cache", type=Path, default=a / "cache", help="the feature, parse and vector cache")
    ap.add_argument("--seed", type=int, default=1, help="seed of the absent-object captions' draw")
    ap.add_argument("--proxy", choices=("described", "named"), default="named",
                    help="what a match is: described alike (the image's captions say what the sentence says), or "
                         "that or the image holds every thing the sentence names (what the relevance is fitted to)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/relevance-dev.csv"), help="the table written")
    args, command = parse_run(ap, argv, "bench.relevance_bench")
    bundle = Bundle.load(args.model)
    models = {"model": bundle}
    if args.baseline is not None:
        models["baseline"] = Bundle.load(args.baseline)
    scales = {name: b.relevance for name, b in models.items()}
    missing = [name for name, rel in scales.items() if rel is None]
    if missing:
        raise SystemExit(f"no relevance scale in the {' and '.join(missing)}: python -m fragsearch.training.calibrate "
                         "--relevance-only")
    parser = make_parser(bundle.text.cfg.parser)
    data = load_split_data(args.data, args.split, bundle.image_cfg, args.cache, parser)
    bundle.text.warm(data.parsed, data.sentences, args.cache / "vectors")
    matches = matches_of(data)
    if args.proxy == "named":
        from fragsearch.model.entities import read_entities
        from fragsearch.training.evidence import things_named_of

        entities = args.data.parent / "flickr30k-entities"
        matches = matches | things_named_of(data, read_entities(entities, data.names) if entities.exists() else {})
    texts, nouns = absent_object_captions(load_split(args.data, "train"), data, parser, args.seed)
    scored: dict[str, tuple[dict[str, float], np.ndarray, np.ndarray]] = {}
    examples: dict[str, list[dict[str, Any]]] = {}
    for name, b in models.items():  # each model's own scores: a baseline may be another score, not only a scale
        metrics, scores = evaluate_scores(b, data)
        absent = (score_split(b, data.feats, b.text.encode(texts, strict=False)) if texts
                  else np.zeros((len(data.names), 0)))
        scored[name] = (metrics, scores, absent)
        examples[name] = best_images(b, data, EXAMPLES)
    metrics = scored["model"][0]
    logger.info("%d training captions about an object no dev caption names (%s, ...)", len(texts),
                ", ".join(sorted(set(nouns))[:12]))
    where = {"machine": machine(), "command": command}
    summary: dict[str, Any] = {"split": args.split, "images": len(data.names), "sentences": len(data.sentences),
                               "rsum": round(metrics["rsum"], 2), "absent_object_captions": len(texts),
                               "absent_object_nouns": sorted(set(nouns)), "cutoff": DEFAULT_CUTOFF, "proxy": args.proxy,
                               **where}
    rows: list[dict[str, Any]] = []
    tables: dict[str, list[dict[str, Any]]] = {}
    for name, rel in scales.items():
        assert rel is not None
        b = models[name]
        scale = b.evidence if rel.uses_evidence else None
        terms = None if scale is None else pair_terms(b, scale, data)
        absent_terms = None if scale is None or not texts else text_terms(b, scale, data, texts)
        out, table = measure(rel, scored[name][1], matches, data.pair_image, scored[name][2], terms, absent_terms)
        out["rsum"] = round(scored[name][0]["rsum"], 2)
        out["examples"] = examples[name]
        summary[name] = out
        tables[name] = table
        rows += [{"scale": name, **r} for r in table]
        logger.info("%s: %s", name, json.dumps(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], "machine", "command"])
        w.writeheader()
        w.writerows({**r, **where} for r in rows)
    ngm = args.out.with_name(args.out.stem + "-no-good-match.csv")
    with ngm.open("w", newline="") as f:
        keys = list(summary["model"]["no_good_match"])
        w = csv.DictWriter(f, fieldnames=["scale", *keys, "machine", "command"])
        w.writeheader()
        w.writerows({"scale": name, **summary[name]["no_good_match"], **where} for name in scales)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(tables, summary, args.out.with_suffix(".png"))
    logger.info("wrote %s, %s, the summary and the plot", args.out, ngm)


def plot(tables: dict[str, list[dict[str, Any]]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, side in zip(axes, ("search", "annotate"), strict=True):
        ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfectly reliable")
        for name, table in tables.items():
            filled = [r for r in table if r["direction"] == side and r["pairs"]]
            ax.plot([r["predicted"] for r in filled], [r["observed"] for r in filled], marker="o",
                    label=f"{name} (ECE {summary[name][side]['ece']:.3f})")
        ax.set_xlabel("relevance shown (bin mean)")
        ax.set_ylabel("observed share of matches")
        ax.set_title(f"{side}: the {SHOWN} best results of each dev query")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
