"""How alike are the images /search/similar returns? A proxy no model was tuned to: the query's and
each result's own Flickr8K dev captions (which neither the model nor the sentence collection of
training captions has seen) and the content words they share.

    python -m bench.similar_bench                       # the served model and indexes, all dev images

For each dev image as the query, the top 10 other dev images by each method:
  - `similar`: the service's more-like-this as served (index/similar.py: ranked by the cosine of the
    mean embedded fragments, kept per index; the 10 shown aligned to the query's 5 best training
    captions, which explain them): its time is the whole answer's, explanation included;
  - `similar-sentences`: the earlier way (with --sentences-ranking): the 5 training captions with the
    best S_kl for the query, their fragments together searched by S_kl;
  - `fragment-mean`: cosine of the mean embedded fragments (the shared space, no sentences);
  - `cnn-frame`: cosine of the whole-image backbone feature (what an image-only search would use);
  - `random`: random other images (seeded).
Measured per result against the query, over content words of the captions (lower case, no stop
words, a trailing plural s dropped): `jaccard` of the two images' word sets, `share_any` = at least
one word in common, `share_3` = at least three. Averages over queries of the top-1 and top-10 lists.
Writes docs/results/similar-dev.csv (the command in its last column).
"""

from __future__ import annotations

import argparse
import csv
import logging
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from spacy.lang.en.stop_words import STOP_WORDS
from tqdm import tqdm

from bench import machine
from fragsearch.index import ImageIndex, SentenceIndex
from fragsearch.index.similar import describe, more_like_this
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.embed import EmbeddedSentence
from fragsearch.model.onnx import set_threads
from fragsearch.settings import default_artifacts_dir, default_data_dir, default_model_path

logger = logging.getLogger("bench.similar_bench")
K = 10
COLUMNS = ["method", "queries", "jaccard_at_1", "jaccard_at_10", "share_any_at_10", "share_3_at_10", "ms_per_query",
           "machine", "command"]


def content_words(captions: Sequence[str]) -> set[str]:
    out = set()
    for c in captions:
        for w in c.lower().split():
            w = "".join(ch for ch in w if ch.isalpha())
            if len(w) < 3 or w in STOP_WORDS:
                continue
            out.add(w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w)
    return out


def cosine_ranker(vectors: np.ndarray) -> Callable[[int], list[int]]:
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)

    def rank(q: int) -> list[int]:
        sims = unit @ unit[q]
        sims[q] = -np.inf
        return [int(i) for i in np.argsort(-sims, kind="stable")[:K]]

    return rank


def measure(name: str, rank: Callable[[int], list[int]], words: list[set[str]], queries: Sequence[int],
            command: str) -> dict[str, object]:
    j1, j10, any10, three10 = [], [], [], []
    t0 = time.perf_counter()
    for q in tqdm(queries, desc=name, unit="query"):
        top = rank(q)[:K]
        jac = [len(words[q] & words[r]) / max(1, len(words[q] | words[r])) for r in top]
        common = [len(words[q] & words[r]) for r in top]
        j1.append(jac[0])
        j10.append(float(np.mean(jac)))
        any10.append(float(np.mean([c >= 1 for c in common])))
        three10.append(float(np.mean([c >= 3 for c in common])))
    ms = (time.perf_counter() - t0) * 1000 / max(1, len(queries))
    row = {"method": name, "queries": len(queries), "jaccard_at_1": round(float(np.mean(j1)), 4),
           "jaccard_at_10": round(float(np.mean(j10)), 4), "share_any_at_10": round(float(np.mean(any10)), 4),
           "share_3_at_10": round(float(np.mean(three10)), 4), "ms_per_query": round(ms, 1),
           "machine": machine(), "command": command}
    logger.info("%s", row)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = default_artifacts_dir()
    ap.add_argument("--model", type=Path, default=default_model_path(),
                    help="the checkpoint; default: the served model (model/release.py)")
    ap.add_argument("--images", type=Path, default=a / "index" / "images-dev", help="the dev image index")
    ap.add_argument("--sentences", type=Path, default=a / "index" / "sentences-train",
                    help="the sentence index (training captions)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=a / "cache", help="the feature cache (for cnn-frame)")
    ap.add_argument("--queries", type=int, default=0, help="the first N dev images as queries (0: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random baseline")
    ap.add_argument("--sentences-ranking", action="store_true",
                    help="also the earlier ranking through the descriptions by S_kl (slow: ~0.4 s a query)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/similar-dev.csv"), help="the CSV written")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_threads(1)
    command = "python -m bench.similar_bench " + shlex.join(sys.argv[1:] if argv is None else argv)

    bundle = Bundle.load(args.model)
    images = ImageIndex.load(args.images, bundle)
    sentences = SentenceIndex.load(args.sentences, bundle)
    split = load_split(args.data, "dev")
    captions = dict(zip(split.images, split.captions, strict=True))
    ids = [i for i in images.ids() if images.get(i) is not None]
    names = [images.get(i).name for i in ids]  # type: ignore[union-attr]
    keep = [n in captions for n in names]
    ids = [i for i, k in zip(ids, keep, strict=True) if k]
    names = [n for n, k in zip(names, keep, strict=True) if k]
    position = {i: p for p, i in enumerate(ids)}
    words = [content_words(captions[n]) for n in names]
    queries = list(range(len(ids) if args.queries <= 0 else min(args.queries, len(ids))))
    logger.info("%d dev images, %d queries", len(ids), len(queries))

    frags = [images.fragments(i) for i in ids]

    def similar(q: int) -> list[int]:
        img, boxes = frags[q]  # type: ignore[misc]
        hits = more_like_this(images, sentences, img, boxes, k=K, exclude=ids[q]).hits
        return [position[h.image_id] for h in hits if h.image_id in position]

    def similar_sentences(q: int) -> list[int]:
        img, boxes = frags[q]  # type: ignore[misc]
        _, sent, triplets = describe(sentences, images, img, boxes, 5)
        if sent is None:
            return []
        hits = images.search(EmbeddedSentence(sent, triplets), K + 1, 0).hits
        return [position[h.image_id] for h in hits if h.image_id in position and h.image_id != ids[q]][:K]

    mean_frag = np.stack([f[0].mean(0) for f in frags if f is not None])
    cnn = np.stack([f.features[0] for f in feature_cache(args.cache, bundle.image_cfg).load(
        [split.image_path(n) for n in names])])
    rng = np.random.default_rng(args.seed)

    def random_rank(q: int) -> list[int]:
        others = np.delete(np.arange(len(ids)), q)
        return [int(i) for i in rng.choice(others, K, replace=False)]

    similar(0)  # the mean vectors are computed once per index (kept and extended as images are added)
    rows = [measure("similar", similar, words, queries, command),
            *([measure("similar-sentences", similar_sentences, words, queries, command)]
              if args.sentences_ranking else []),
            measure("fragment-mean", cosine_ranker(mean_frag), words, queries, command),
            measure("cnn-frame", cosine_ranker(cnn), words, queries, command),
            measure("random", random_rank, words, queries, command)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
