"""How far can an image's own features tell that a thing is absent from a collection? The ceiling of the
phrase-evidence bench's both sides (bench/phrase_evidence.py), on dev.

    python -m bench.evidence_ceiling --out docs/results/evidence-ceiling-dev.json

The phrase-evidence bench asks a dev caption of the collection with every picture that names one of its things
kept (present) and removed (absent), and reads the best relevance of the `SHOWN` best results. Here the same
queries are read through signals that know more than any served relevance can:

- ``score``: the best shown S_kl score (no relevance at all).
- ``relevance``: the best shown relevance as the model serves it (the bench's own ``auc``).
- ``tagger_shown`` / ``tagger_collection``: an image tagger told which thing was removed. The tagger is a
  linear multi-label classifier over the nouns named by at least `MIN_TRAIN` training pictures, reading each
  picture's calibrated fragments (their largest, their mean and the whole frame's), fitted on the training
  images' captions and Entities phrases (fixed settings, nothing chosen on dev). Its logit of the removed thing,
  at best over the shown results, or over the whole collection.
- ``tagger_image_auc``: the same tagger's AUC per picture (pictures naming the thing against the others), the
  mean over the asked things.
- ``present_shown_holds``: the share of present queries whose shown results hold a picture naming the thing at
  all (the answers a present query can honestly be given).

A thing a collection lacks is told from one it holds only when no picture of the collection looks like it: the
collection-level AUC asks the largest of hundreds of per-picture scores to separate, which a per-picture AUC
short of 1 does not give.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench import machine, parse_run, write_result
from bench.photo_decode import cpu_flags
from bench.phrase_evidence import SHOWN, Dev, Model, asked_queries, best_shown, holders, load_dev
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData, load_split_data
from fragsearch.model.entities import read_entities
from fragsearch.model.parsers import make_parser
from fragsearch.model.release import RELEASED_MODEL
from fragsearch.settings import default_cache_dir, default_data_dir
from fragsearch.training.evidence import auc, image_words, names_in, word_counts

logger = logging.getLogger("bench.evidence_ceiling")
MIN_TRAIN = 3  # training pictures naming a noun for the tagger to learn it
EPOCHS = 60
SEED = 0


def descriptors(bundle: Bundle, feats: np.ndarray) -> np.ndarray:
    """(N, 3h) each picture's calibrated fragments: their largest, their mean, the whole frame's."""
    e = np.concatenate([bundle.embed_images(feats[k : k + 256]) for k in range(0, len(feats), 256)])
    return np.concatenate([e.max(axis=1), e.mean(axis=1), e[:, 0]], axis=1).astype(np.float32)


def fit_tagger(x: np.ndarray, y: np.ndarray, epochs: int = EPOCHS, seed: int = SEED) -> Any:
    """A linear multi-label tagger (standardized inputs) → a function of descriptors to logits."""
    import torch

    torch.manual_seed(seed)
    mu, sd = x.mean(axis=0), x.std(axis=0) + 1e-6
    xs, ys = torch.tensor((x - mu) / sd), torch.tensor(y)
    lin = torch.nn.Linear(x.shape[1], y.shape[1])
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    for _ in tqdm(range(epochs), desc="tagger", unit="epoch"):
        order = torch.randperm(len(xs), generator=gen)
        for i in range(0, len(xs), 256):
            j = order[i : i + 256]
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(lin(xs[j]), ys[j]).backward()
            opt.step()

    def logits(d: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return np.asarray(lin(torch.tensor((d - mu) / sd)).numpy())

    return logits


def vocabulary(train: SplitData) -> list[str]:
    return [w for w, count in word_counts(train).items() if count >= MIN_TRAIN]


def measure(model: Model, dev: Dev, train: SplitData, data: Path) -> dict[str, Any]:
    vocab = vocabulary(train)
    index = {w: j for j, w in enumerate(vocab)}
    words = image_words(train, read_entities(data.parent / "flickr30k-entities", train.names))
    y = np.array([[names_in(ws, w) for w in vocab] for ws in words], np.float32)
    tagger = fit_tagger(descriptors(model.bundle, train.feats), y)
    tags = tagger(descriptors(model.bundle, dev.data.feats))  # (N, V)
    n = len(dev.data.names)
    asked = asked_queries(dev)
    sides: dict[str, tuple[list[float], list[float]]] = {
        k: ([], []) for k in ("score", "relevance", "tagger_shown", "tagger_collection")}
    holds_shown: list[bool] = []
    image_aucs: dict[str, float] = {}
    for l, w in tqdm(asked, desc="both sides", unit="query"):  # noqa: E741
        holds = holders(dev, w)
        if w in index and w not in image_aucs:
            image_aucs[w] = auc(tags[:, index[w]], holds.astype(np.float64))
        for side, keep in ((0, np.ones(n, bool)), (1, ~holds)):
            scores = np.where(keep, dev.scores[:, l], -np.inf)
            top = np.lexsort((np.arange(n), -scores))[:SHOWN]
            if side == 0:
                holds_shown.append(bool(holds[top].any()))
            sides["score"][side].append(float(scores[top].max()))
            sides["relevance"][side].append(best_shown(model, dev, l, keep))
            tag = tags[:, index[w]] if w in index else np.zeros(n, np.float32)
            sides["tagger_shown"][side].append(float(tag[top].max()))
            sides["tagger_collection"][side].append(float(tag[keep].max()))
    out: dict[str, Any] = {"queries": len(asked), "things": len({w for _, w in asked}),
                           "things_in_tagger": len(image_aucs), "tagger_vocabulary": len(vocab)}
    for k, (p, a) in sides.items():
        out[f"auc_{k}"] = round(auc(np.r_[p, a], np.r_[np.ones(len(p)), np.zeros(len(a))]), 4)
    out["tagger_image_auc"] = round(float(np.mean(list(image_aucs.values()))), 4)
    out["tagger_image_auc_median"] = round(float(np.median(list(image_aucs.values()))), 4)
    out["present_shown_holds"] = round(float(np.mean(holds_shown)), 4)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=RELEASED_MODEL, help="the model (default: the released one)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature and parse cache")
    ap.add_argument("--workers", type=int, default=2, help="extraction processes for images not cached")
    ap.add_argument("--out", type=Path, default=Path("docs/results/evidence-ceiling-dev.json"),
                    help="the results JSON")
    args, command = parse_run(ap, argv, "bench.evidence_ceiling")
    bundle = Bundle.load(args.model)
    model = Model(bundle, bundle.relevance)
    dev = load_dev(model, args.data, args.cache, args.workers, None)
    train = load_split_data(args.data, "train", bundle.image_cfg, args.cache, make_parser(bundle.text.cfg.parser),
                            workers=args.workers, device="cpu")
    result = measure(model, dev, train, args.data)
    result.update(model=str(args.model), machine=machine(), cpu_flags=cpu_flags(), command=command)
    logger.info("%s", result)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
