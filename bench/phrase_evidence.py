"""Phrase evidence and the relevance built on it, on dev: does an answer say what is not there?

    python -m bench.phrase_evidence --model artifacts/models/released-evidence \\
        --out docs/results/phrase-evidence-dev.csv --plot docs/results/phrase-evidence-dev.png
    python -m bench.phrase_evidence --merge            # today's released model's row beside it

Both sides of "no good match", on collections made from the 1,000 dev images (model selection never reads
dev; the scales are fitted on the validation part of the training images):
- **present**: a dev caption that names a thing (model/evidence.py `named_things`) is asked of the whole dev
  collection, where its own picture and every other picture whose captions or Entities phrases name the thing
  are kept. The honest answer is the pictures: the query is answered when one of its `SHOWN` best results
  reaches the cut-off (`DEFAULT_CUTOFF`).
- **absent**: the same caption asked of the collection with every picture that names the thing removed. The
  honest answer is no good match: the query is refused when none of its `SHOWN` best results reaches it.
  ``auc`` is the area under the ROC curve of the best shown relevance, present against absent.
- **swapped**: a dev caption whose first named thing is swapped for a noun no dev caption uses (`SWAPS`; "a
  giraffe runs through the grass"), asked of the whole collection: the swapped thing must be reported not found
  on the top result (``swapped_not_found``).
- **own**: every phrase of a dev caption with a Flickr30k Entities box in its own image must be found there
  (``own_found``).
- **calibration**: the relevance of every dev caption's `SHOWN` best results against whether people's captions
  describe the picture alike (training/relevance.py `described_alike`): the expected calibration error
  (``ece``) and the reliability plot.

A model without phrase evidence (one made before it) is measured as it answers: its relevance without the
evidence, and a phrase counted found wherever its alignment draws a region (a positive fragment score).
Things asked about are the dev nouns named by at least `MIN_IMAGES` pictures and by no more than `MAX_SHARE` of
them (a collection without them is still a collection); `PER_THING` captions each.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench import kept_rows, machine, parse_run, write_rows
from bench.photo_decode import cpu_flags
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import DEFAULT_CUTOFF, Relevance
from fragsearch.model.dataset import SplitData, load_split_data
from fragsearch.model.embed import embed_encoded, embed_texts
from fragsearch.model.entities import read_entities
from fragsearch.model.evidence import FOUND, SentenceEvidence, named_things
from fragsearch.model.parsers import make_parser
from fragsearch.model.release import RELEASE_DIR, RELEASED_MODEL, read_manifest
from fragsearch.model.score import align
from fragsearch.model.text import Triplet
from fragsearch.settings import default_cache_dir, default_data_dir
from fragsearch.training.evidence import auc, image_words, names_in, things_named_of
from fragsearch.training.relevance import calibration_error, described_alike, reliability

logger = logging.getLogger("bench.phrase_evidence")
SHOWN = 10  # results of a query whose relevance is read (a page)
MIN_IMAGES = 5
MAX_SHARE = 0.2
PER_THING = 4
SWAPPED = 1000  # captions asked with a swapped thing
# things a person may ask for that Flickr8K's pictures rarely hold; those no dev caption names are used
SWAPS = ("giraffe", "elephant", "zebra", "tiger", "lion", "laptop", "piano", "violin", "tuxedo", "kangaroo",
         "penguin", "airplane", "helicopter", "microscope", "typewriter", "cactus", "volcano", "lighthouse",
         "camel", "octopus", "rhinoceros", "trombone", "chandelier", "skyscraper", "submarine", "tractor")


@dataclass
class Model:
    """A model as the bench reads it: its bundle, its relevance with and without the evidence."""

    bundle: Bundle
    relevance: Relevance | None

    @property
    def evidence(self) -> bool:
        return self.bundle.evidence is not None and self.relevance is not None and self.relevance.uses_evidence


@dataclass
class Dev:
    data: SplitData
    images: np.ndarray  # (N, F, h) calibrated
    embedded: list[tuple[np.ndarray, list[Triplet]]]
    scores: np.ndarray  # (N, L)
    words: list[set[str]]
    things: list[list[str]] = field(default_factory=list)


def load_dev(model: Model, data: Path, cache: Path, workers: int, limit: int | None) -> Dev:
    b = model.bundle
    dev = load_split_data(data, "dev", b.image_cfg, cache, make_parser(b.text.cfg.parser), workers=workers,
                          limit=limit, device="cpu")
    images = np.concatenate([b.embed_images(dev.feats[k : k + 256]) for k in range(0, len(dev.names), 256)])
    embedded = embed_encoded(b, b.text.encode_parsed(dev.parsed, dev.sentences))
    t = max(len(s) for s, _ in embedded)
    sent = np.zeros((len(embedded), t, b.dim), np.float32)
    mask = np.zeros((len(embedded), t), np.float32)
    for n, (s, _) in enumerate(embedded):
        sent[n, : len(s)], mask[n, : len(s)] = s, 1
    ones = np.ones(images.shape[:2], np.float32)
    scores = np.concatenate([b.scores(images, ones, sent[s : s + 500], mask[s : s + 500])
                             for s in range(0, len(sent), 500)], axis=1)
    ents = read_entities(data.parent / "flickr30k-entities", dev.names)
    out = Dev(dev, images, embedded, scores, image_words(dev, ents))
    out.things = [named_things(triplets) for _, triplets in embedded]
    return out


def found_in(model: Model, ev: SentenceEvidence | None, sent: np.ndarray, triplets: list[Triplet],
             img: np.ndarray) -> dict[str, float]:
    """Each named thing's found in one image: the evidence's probability, or (a model without evidence) 1 where
    one of its triplets aligns to a region with a positive score, else 0."""
    if ev is not None:
        return ev.found(img).things
    al = align(img, sent, model.bundle.blocks)
    things = named_things(triplets)
    return {w: float(any(ok for t, ok in zip(triplets, al.matched, strict=True) if w in (t.w1, t.w2)))
            for w in things}


def best_shown(model: Model, dev: Dev, l: int, keep: np.ndarray) -> float:  # noqa: E741
    """The best relevance among caption l's `SHOWN` best results in the collection `keep` (bool over images)."""
    assert model.relevance is not None
    scores = np.where(keep, dev.scores[:, l], -np.inf)
    rel = model.relevance.for_query("search", scores[keep], int(keep.sum()))
    top = np.argsort(-scores, kind="stable")[:SHOWN]
    top = top[np.isfinite(scores[top])]
    terms = None
    if model.evidence:
        sent, triplets = dev.embedded[l]
        scale = model.bundle.evidence
        assert scale is not None
        ev = scale.for_sentence(sent, triplets)
        terms = np.stack([ev.found(dev.images[k]).terms() for k in top])
    return float(rel(scores[top], terms).max())


def asked_queries(dev: Dev, seed: int = 0) -> list[tuple[int, str]]:
    """The (caption, thing) pairs both sides ask: `PER_THING` captions of each thing named by at least
    `MIN_IMAGES` pictures and by no more than `MAX_SHARE` of them."""
    n = len(dev.data.names)
    rng = np.random.default_rng(seed)
    asked: list[tuple[int, str]] = []
    by_thing: dict[str, list[int]] = {}
    for l, things in enumerate(dev.things):  # noqa: E741
        for w in things:
            by_thing.setdefault(w, []).append(l)
    for w in sorted(by_thing):
        if MIN_IMAGES <= holders(dev, w).sum() <= MAX_SHARE * n:
            ls = by_thing[w]
            for l in rng.choice(ls, size=min(PER_THING, len(ls)), replace=False):  # noqa: E741
                asked.append((int(l), w))
    return asked


def holders(dev: Dev, thing: str) -> np.ndarray:
    """(N,) bool: the dev pictures whose captions or Entities phrases name `thing`."""
    return np.array([names_in(words, thing) for words in dev.words])


def both_sides(model: Model, dev: Dev, seed: int = 0) -> dict[str, Any]:
    """present_answered, absent_refused and their AUC (see the module's note)."""
    n = len(dev.data.names)
    asked = asked_queries(dev, seed)
    present, absent = [], []
    for l, w in tqdm(asked, desc="present and absent", unit="query"):  # noqa: E741
        holds = holders(dev, w)
        present.append(best_shown(model, dev, l, np.ones(n, bool)))
        absent.append(best_shown(model, dev, l, ~holds))
    p, a = np.array(present), np.array(absent)
    return {"queries": len(asked), "things": len({w for _, w in asked}),
            "auc": round(auc(np.r_[p, a], np.r_[np.ones(len(p)), np.zeros(len(a))]), 4),
            "present_answered": round(float((p >= DEFAULT_CUTOFF).mean()), 4),
            "absent_refused": round(float((a < DEFAULT_CUTOFF).mean()), 4),
            "present_median": round(float(np.median(p)), 4), "absent_median": round(float(np.median(a)), 4)}


def swapped(model: Model, dev: Dev, seed: int = 0) -> dict[str, Any]:
    """The share of swapped things reported not found on the top result."""
    vocabulary = set().union(*dev.words)
    swaps = [w for w in SWAPS if not names_in(vocabulary, w)]
    rng = np.random.default_rng(seed)
    chosen = [l for l, things in enumerate(dev.things) if things]  # noqa: E741
    chosen = list(rng.choice(chosen, size=min(SWAPPED, len(chosen)), replace=False))
    texts = []
    for n, l in enumerate(chosen):  # noqa: E741
        old = dev.things[l][0]
        texts.append(re.sub(rf"\b{re.escape(old)}\b", swaps[n % len(swaps)], dev.data.sentences[l].lower(), count=1))
    b = model.bundle
    asked = not_found = 0
    scale = b.evidence if model.evidence else None
    ones = np.ones(dev.images.shape[:2], np.float32)
    for n, (sent, triplets) in enumerate(tqdm(embed_texts(b, texts, strict=False), desc="swapped", unit="query")):
        swap = swaps[n % len(swaps)]
        if not len(sent) or swap not in named_things(triplets):
            continue
        scores = b.scores(dev.images, ones, sent[None], np.ones((1, len(sent)), np.float32))[:, 0]
        top = int(np.lexsort((np.arange(len(scores)), -scores))[0])
        ev = None if scale is None else scale.for_sentence(sent, triplets)
        asked += 1
        not_found += found_in(model, ev, sent, triplets, dev.images[top]).get(swap, 0.0) < FOUND
    return {"swapped": asked, "swaps": len(swaps), "swapped_not_found": round(not_found / max(asked, 1), 4)}


def own(model: Model, dev: Dev, data: Path) -> dict[str, Any]:
    """The share of boxed phrases (their head a named thing) found on their own image."""
    ents = read_entities(data.parent / "flickr30k-entities", dev.data.names)
    scale = model.bundle.evidence if model.evidence else None
    asked = found = 0
    for l, (sent, triplets) in enumerate(tqdm(dev.embedded, desc="own", unit="caption")):  # noqa: E741
        k = int(dev.data.pair_image[l])
        image = ents.get(dev.data.names[k])
        caption = image.match(dev.data.sentences[l]) if image is not None else None
        if image is None or caption is None or not len(sent):
            continue
        heads = {p.head for p in image.boxed(caption)} & set(dev.things[l])
        if not heads:
            continue
        got = found_in(model, None if scale is None else scale.for_sentence(sent, triplets), sent, triplets,
                       dev.images[k])
        asked += len(heads)
        found += sum(got.get(h, 0.0) >= FOUND for h in heads)
    return {"own_phrases": asked, "own_found": round(found / max(asked, 1), 4)}


def calibration(model: Model, dev: Dev, data: Path) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """ECE of the shown results' relevance against the described-alike proxy (``ece``) and against the proxy a
    person's phrase-by-phrase judgment is closer to, described alike or holding every thing the caption names
    (``ece_named``, training/evidence.py `named_alike`); the reliability table is the second's."""
    from fragsearch.model.words import encode_sentences

    assert model.relevance is not None
    alike = described_alike(encode_sentences(dev.data.sentences), dev.data.pair_image)  # (N, L)
    named = alike | things_named_of(dev.data, read_entities(data.parent / "flickr30k-entities", dev.data.names))
    preds: list[np.ndarray] = []
    truth: list[np.ndarray] = []
    truth_named: list[np.ndarray] = []
    scale = model.bundle.evidence if model.evidence else None
    for l in tqdm(range(dev.scores.shape[1]), desc="calibration", unit="query"):  # noqa: E741
        scores = dev.scores[:, l]
        rel = model.relevance.for_query("search", scores)
        top = np.lexsort((np.arange(len(scores)), -scores))[:SHOWN]
        terms = None
        if scale is not None:
            sent, triplets = dev.embedded[l]
            ev = scale.for_sentence(sent, triplets)
            terms = np.stack([ev.found(dev.images[k]).terms() for k in top])
        preds.append(rel(scores[top], terms))
        truth.append(alike[top, l])
        truth_named.append(named[top, l])
    p = np.concatenate(preds)
    table = reliability(p, np.concatenate(truth_named).astype(np.float64))
    return {"ece": round(calibration_error(reliability(p, np.concatenate(truth).astype(np.float64))), 4),
            "ece_named": round(calibration_error(table), 4)}, table


def plot(tables: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls=":")
    for name, table in tables.items():
        rows = [r for r in table if r["pairs"]]
        ax.plot([r["predicted"] for r in rows], [r["observed"] for r in rows], marker="o", label=name)
    ax.set_xlabel("relevance shown")
    ax.set_ylabel("share of matches (dev, judged phrase by phrase)")
    ax.set_title("dev: the relevance of the 10 best results of each caption")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def measure(model: Model, name: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, float]]]:
    dev = load_dev(model, args.data, args.cache, args.workers, args.limit)
    sides = both_sides(model, dev)
    swap = swapped(model, dev)
    mine = own(model, dev, args.data)
    cal, table = calibration(model, dev, args.data)
    row = {"model": name, **{k: sides[k] for k in ("auc", "present_answered", "absent_refused")},
           "swapped_not_found": swap["swapped_not_found"], "own_found": mine["own_found"], "ece": cal["ece"],
           "ece_named": cal["ece_named"], "evidence": model.evidence, "queries": sides["queries"],
           "things": sides["things"],
           "present_median": sides["present_median"], "absent_median": sides["absent_median"],
           "swapped": swap["swapped"], "own_phrases": mine["own_phrases"]}
    logger.info("%s", row)
    return row, table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=RELEASED_MODEL, help="the model (default: the released one)")
    ap.add_argument("--name", default=None, help="the row's model cell (default: 'released <row>' or the folder)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature and parse cache")
    ap.add_argument("--workers", type=int, default=2, help="extraction processes for dev images not cached")
    ap.add_argument("--limit", type=int, default=None, help="only the first N dev images (a trial)")
    ap.add_argument("--without-evidence", action="store_true",
                    help="measure the model as it answers without its phrase evidence (today's answers)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/phrase-evidence-dev.csv"),
                    help="the results CSV, a row per model")
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of the reliability of each row's relevance")
    ap.add_argument("--merge", action="store_true", help="keep the rows of other models already in the results")
    args, command = parse_run(ap, argv, "bench.phrase_evidence")
    bundle = Bundle.load(args.model)
    released = Path(args.model).resolve() == Path(RELEASED_MODEL).resolve()
    name = args.name or (f"released {read_manifest(RELEASE_DIR).get('row', '')}".strip() if released
                         else Path(args.model).name)
    relevance = bundle.relevance
    if args.without_evidence and bundle.calibration is not None:
        relevance = None if relevance is None else replace(relevance, evidence=(0.0, 0.0))
        bundle.calibration = replace(bundle.calibration, evidence=None, relevance=relevance)
    row, table = measure(Model(bundle, relevance), name, args)
    row.update(machine=machine(), cpu_flags=cpu_flags(), command=command)
    rows: list[dict[str, Any]] = [*kept_rows(args.out, args.merge, [name]), row]
    write_rows(args.out, list(row), rows)
    if args.plot is not None:
        tables_path = args.out.with_suffix(".reliability.csv")
        kept: list[dict[str, Any]] = list(kept_rows(tables_path, args.merge, [name]))
        mine: list[dict[str, Any]] = [{"model": name, **r} for r in table]
        write_rows(tables_path, ["model", *table[0]], [*kept, *mine])
        tables: dict[str, list[dict[str, float]]] = {}
        for r in [*kept, *mine]:
            tables.setdefault(str(r["model"]), []).append({k: float(v) for k, v in r.items() if k != "model"})
        plot(tables, args.plot)


if __name__ == "__main__":
    main()
