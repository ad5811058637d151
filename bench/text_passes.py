"""Where a model's whole-sentence vector is read from (`TextConfig.sentence_pass`): a MiniLM pass over the caption's
text ("text", the trained models' reading: a second pass for every caption whose text tokenizes otherwise than its
words, punctuation included) or the words' own pass ("words": one pass a caption), side by side for one model:

    python -m bench.text_passes --out docs/results/text-passes.csv

For each reading: the recall of the model on its validation part (the training images it held out, where a
choice between the two would be made) and on dev (read for the table, never to choose), the MiniLM passes the
caption side makes, and the seconds it takes to read the first `--captions` training captions (parsed once
beforehand; each reading timed `--rounds` times in turn, the medians written, with the ratio to "text"). The model
is not retrained: a model trained with the other reading would be read as it was trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine, parse_run, write_rows
from bench.photo_decode import cpu_flags
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import SENTENCE_PASSES
from fragsearch.model.data import load_split
from fragsearch.model.dataset import held_out_split, load_split_data
from fragsearch.model.minilm import minilm
from fragsearch.settings import default_cache_dir, default_data_dir, default_model_path
from fragsearch.training.evaluate import evaluate

logger = logging.getLogger("bench.text_passes")
METRICS = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10")


def reading(bundle: Bundle, sentence_pass: str) -> None:
    """Read the model's text with `sentence_pass` from now on (its in-memory vectors dropped)."""
    bundle.text.cfg = dataclasses.replace(bundle.text.cfg, sentence_pass=sentence_pass)
    bundle.text.forget()


def passes(parsed: list[Any], captions: list[str], sentence_pass: str) -> int:
    """MiniLM passes the caption side makes for these captions (model/words.py `encode_texts`)."""
    model = minilm()
    words = model.word_pieces([list(p.tokens) or [""] for p in parsed])
    if sentence_pass == "words":
        return len(words)
    texts = model.pieces([c.strip() for c in captions])
    return sum(1 if t.same_ids(w) else 2 for t, w in zip(texts, words, strict=True))


def seconds(bundle: Bundle, parsed: list[Any], captions: list[str]) -> float:
    """Wall seconds to read these captions' vectors, the in-memory vectors dropped first."""
    bundle.text.forget()
    t0 = time.perf_counter()
    bundle.text.frozen_vectors(parsed, captions)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path(),
                    help="the model (default: the served one; it must have been trained with --selection val)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature and parse cache")
    ap.add_argument("--captions", type=int, default=3000, help="training captions of the timed caption pass")
    ap.add_argument("--rounds", type=int, default=3, help="timings of each reading (medians written)")
    ap.add_argument("--workers", type=int, default=2, help="extraction processes for features not cached yet")
    ap.add_argument("--out", type=Path, default=Path("docs/results/text-passes.csv"), help="the CSV written")
    args, command = parse_run(ap, argv, "bench.text_passes")
    bundle = Bundle.load(args.model)
    if not bundle.text.cfg.sentence_fragment or bundle.text.cfg.word_vectors != "contextual":
        ap.error("the model reads no whole-sentence vector beside contextual words: both readings are the same")
    selection = bundle.meta.get("train", {})
    if selection.get("selection") != "val":
        ap.error("the model was not trained with --selection val: it has no validation part to compare on")
    train = load_split(args.data, "train")
    parts = {"val": held_out_split(train, int(selection["val_images"]), int(selection["val_seed"])),
             "dev": load_split(args.data, "dev")}
    data = {name: load_split_data(args.data, split, bundle.image_cfg, args.cache, bundle.text.parser,
                                  workers=args.workers) for name, split in parts.items()}
    captions = [c for caps in train.captions for c in caps][: args.captions]
    parsed = bundle.text.parse(captions)
    metrics: dict[str, dict[str, dict[str, float]]] = {}
    for sentence_pass in SENTENCE_PASSES:
        reading(bundle, sentence_pass)
        metrics[sentence_pass] = {name: evaluate(bundle, d) for name, d in data.items()}
        logger.info("%s: %s", sentence_pass, {n: round(m["rsum"], 2) for n, m in metrics[sentence_pass].items()})
    timings: dict[str, list[float]] = {p: [] for p in SENTENCE_PASSES}
    for r in range(args.rounds):
        for sentence_pass in SENTENCE_PASSES:
            reading(bundle, sentence_pass)
            timings[sentence_pass].append(seconds(bundle, parsed, captions))
            logger.info("round %d, %s: %.1f s", r + 1, sentence_pass, timings[sentence_pass][-1])
    first = float(np.median(timings[SENTENCE_PASSES[0]]))
    name = args.model.parent.name if args.model.suffix else args.model.name
    rows: list[dict[str, object]] = []
    for sentence_pass in SENTENCE_PASSES:
        pass_s = float(np.median(timings[sentence_pass]))
        for split, m in metrics[sentence_pass].items():
            rows.append({"model": name, "sentence_pass": sentence_pass, "split": split,
                         "images": int(m["images"]), "sentences": int(m["sentences"]),
                         **{k: round(float(m[k]), 2) for k in METRICS},
                         "captions": len(captions), "minilm_passes": passes(parsed, captions, sentence_pass),
                         "pass_s": round(pass_s, 2), "pass_ratio": round(pass_s / first, 2), "rounds": args.rounds,
                         "machine": machine(), "cpu_flags": cpu_flags(), "command": command})
    write_rows(args.out, list(rows[0]), rows)


if __name__ == "__main__":
    main()
