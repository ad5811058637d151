"""Fitting phrase evidence (model/evidence.py): the weights of `found` on the validation part of the training
images (the images --selection val held out; never dev), stored with the model's calibration.

Labels, per thing a caption names and image:
- in the caption's own image, a thing whose phrase has a Flickr30k Entities box there is present (for an image
  without Entities annotations, every thing its caption names);
- in another image of the part, a thing is present when one of that image's five captions, or one of its
  boxed Entities phrases, names the same word (singular or plural), and absent when none does.
Each caption is read against its own image, `OTHERS` other images drawn at random, and the images a search of
the part shows first for it (its `SHOWN` best others, and its `SHOWN` best among the pictures that do not
name each of its things: a search of a collection that lacks the thing), so that `found` is calibrated where it
is read, on the results a search shows. The first caption of each picture is also read with its first thing
swapped for a noun the picture does not hold: one the part's pictures often name, and one no caption of the
part the model was trained on uses (a word the model never saw; `found` reads how well it knows each word).

The relevance is then refitted on the part's searches with the evidence of what they show (`pair_terms`), a
shown pair a match when the picture's captions describe it alike (training/relevance.py `alike_blocks`) or
the picture holds every thing the query names (`named_alike`): a person judges phrase by phrase, and calls
any picture of a dog running on grass a match for "a dog runs through the grass".

    python -m fragsearch.training.evidence --model model/released --out artifacts/models/released-evidence
    python -m fragsearch.training.evidence --model artifacts/models/NAME/model.json --out artifacts/models/NAME-evidence
    python -m fragsearch.training.evidence --model model/released --out artifacts/models/released-relevance \
        --relevance-only

The model is written in the runtime's form (a folder) with the evidence weights beside its relevance scale;
the validation measures (AUC of `found` on held-out images of the part, its calibration error) are logged and
kept in the model's metadata.

Its command line: fragsearch/commands/evidence.py (`python -m fragsearch.training.evidence` calls it).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Relevance
from fragsearch.model.dataset import SplitData
from fragsearch.model.embed import embed_encoded, embed_texts
from fragsearch.model.entities import ImageEntities, read_entities
from fragsearch.model.evidence import FOUND, PhraseEvidence, features_of, forms, known, named_things
from fragsearch.training.refit import Refit
from fragsearch.training.relevance import Judged

logger = logging.getLogger("fragsearch.training.evidence")
OTHERS = 40  # other images drawn at random each caption is read against
SHOWN = 5  # and the best others a search of the part ranks first, with and without each thing's pictures
BATCH = 256  # captions embedded at a time
SWAP_MIN_IMAGES = 5  # a swapped caption's noun is one at least this many pictures of the part hold
_WORD = re.compile(r"[a-z]+")


def image_words(data: SplitData, ents: Mapping[str, ImageEntities]) -> list[set[str]]:
    """Per image of `data`: the words of its captions and its Entities phrases."""
    out: list[set[str]] = [set() for _ in data.names]
    for sentence, k in zip(data.sentences, data.pair_image, strict=True):
        out[int(k)].update(_WORD.findall(sentence.lower()))
    for k, name in enumerate(data.names):
        image = ents.get(name)
        for caption in image.captions if image is not None else ():
            for phrase in caption.phrases:
                out[k].update(phrase.words)
    return out


def names_in(words: set[str], thing: str) -> bool:
    return bool(forms(thing) & words)


@dataclass
class Rows:
    """The labelled (thing, image) pairs: features (n, len(scale.features)), present (n,), whether the image is the
    caption's own, and the image each pair is of (for image-disjoint parts)."""

    x: np.ndarray
    y: np.ndarray
    own: np.ndarray
    image: np.ndarray


def evidence_rows(bundle: Bundle, scale: PhraseEvidence, data: SplitData, ents: dict[str, ImageEntities],
                  others: int = OTHERS, seed: int = 0) -> Rows:
    """The labelled pairs of `data`'s captions (see the module's note), read with `scale`'s references."""
    rng = np.random.default_rng(seed)
    images = np.concatenate([bundle.embed_images(data.feats[k : k + 256]) for k in range(0, len(data.names), 256)])
    words = image_words(data, ents)
    enc = bundle.text.encode_parsed(data.parsed, data.sentences)
    xs: list[np.ndarray] = []
    ys: list[float] = []
    owns: list[bool] = []
    of: list[int] = []
    embedded = embed_encoded(bundle, enc)
    scores = caption_scores(bundle, images, embedded)  # (N, L): what a search of `data` ranks by
    for l, (sent, triplets) in enumerate(tqdm(embedded, desc="captions", unit="caption")):  # noqa: E741
        if not len(sent):
            continue
        ev = scale.for_sentence(sent, triplets)
        if not ev.things:
            continue
        k = int(data.pair_image[l])
        image = ents.get(data.names[k])
        caption = image.match(data.sentences[l]) if image is not None else None
        # without Entities annotations for the image (a data set that has none), the things its own caption names
        boxed = (set(ev.things) if image is None else
                 {p.head for p in image.boxed(caption)} if caption is not None else set())
        picks = rng.choice(len(data.names), size=min(others, len(data.names)), replace=False)
        ranked = np.lexsort((np.arange(len(data.names)), -scores[:, l]))
        ranked = ranked[ranked != k]
        holders = {w: np.array([names_in(words[i], w) for i in range(len(data.names))]) for w in ev.things}
        # what searches show: the best others, and the best of those that do not name each thing
        shown = [ranked[:SHOWN], *(ranked[~holders[w][ranked]][:SHOWN] for w in ev.things)]
        picks = np.unique(np.concatenate([picks, *shown]))
        picks = picks[picks != k]
        chosen = np.concatenate([[k], picks]).astype(np.int64)
        feats = np.stack([ev.features(images[i]) for i in chosen])  # (n, things, features)
        for n, thing in enumerate(ev.things):
            if thing in boxed:
                xs.append(feats[0, n])
                ys.append(1.0)
                owns.append(True)
                of.append(k)
            for row, i in enumerate(chosen[1:], start=1):
                xs.append(feats[row, n])
                ys.append(float(holders[thing][int(i)]))
                owns.append(False)
                of.append(int(i))
    return Rows(np.asarray(xs).reshape(-1, len(scale.features)), np.asarray(ys), np.asarray(owns, bool),
                np.asarray(of, np.int64))


def swapped_captions(data: SplitData, words: Sequence[set[str]], firsts: Sequence[tuple[int, str]],
                     rng: np.random.Generator, pool: Sequence[str] | None = None) -> list[tuple[int, str, str]]:
    """(caption, text, noun): each caption of `firsts` (its index in `data`, its first named thing) with that
    thing swapped for a noun its picture does not hold ("a dog runs" -> "a tractor runs"), drawn from `pool`
    (None: the things the captions of `firsts` name that at least `SWAP_MIN_IMAGES` pictures hold)."""
    if pool is None:
        pictures: dict[str, set[int]] = {}
        for k, ws in enumerate(words):
            for x in ws:
                pictures.setdefault(x, set()).add(k)
        named = sorted({w for _, w in firsts})
        pool = [w for w in named
                if len(set().union(*(pictures.get(f, set()) for f in forms(w)))) >= SWAP_MIN_IMAGES]
    out = []
    for c, w in firsts:
        k = int(data.pair_image[c])
        choices = [s for s in (pool[int(i)] for i in rng.integers(len(pool), size=20)) if not names_in(words[k], s)
                   ] if pool else []
        if choices:
            out.append((c, re.sub(rf"\b{re.escape(w)}\b", choices[0], data.sentences[c].lower(), count=1),
                        choices[0]))
    return out


def swapped_rows(bundle: Bundle, scale: PhraseEvidence, data: SplitData, words: Sequence[set[str]],
                 seed: int = 0, unseen: bool = False) -> Rows:
    """The first caption of each picture with its first thing swapped (`swapped_captions`), read in its own
    picture: the swapped thing is absent. `unseen`: swapped for a noun of `data`'s captions that no picture of the
    part the model was trained on names (`scale.counts`: a word the model never saw, as a user's may be)."""
    rng = np.random.default_rng(seed)
    first = [int(np.flatnonzero(data.pair_image == k)[0]) for k in range(len(data.names))
             if (data.pair_image == k).any()]
    enc = bundle.text.encode_parsed([data.parsed[c] for c in first], [data.sentences[c] for c in first])
    said = [named_things(t) for _, t in embed_encoded(bundle, enc)]
    firsts = [(c, things[0]) for c, things in zip(first, said, strict=True) if things]
    pool = None
    if unseen:
        nouns = sorted({w for p in data.parsed for w in named_things(p.triplets)})
        pool = [w for w in nouns if known(w, scale.counts) == 0.0]
        logger.info("%d nouns of the part's captions that the model never saw", len(pool))
    swaps = swapped_captions(data, words, firsts, rng, pool)
    images = bundle.embed_images(data.feats[[int(data.pair_image[c]) for c, _, _ in swaps]]) if swaps else None
    xs, of = [], []
    for n, ((sent, triplets), (c, _, noun)) in enumerate(zip(embed_texts(bundle, [t for _, t, _ in swaps],
                                                                        strict=False), swaps, strict=True)):
        ev = scale.for_sentence(sent, triplets) if len(sent) else None
        if ev is None or noun not in ev.things or images is None:
            continue
        xs.append(ev.features(images[n])[ev.things.index(noun)])
        of.append(int(data.pair_image[c]))
    return Rows(np.asarray(xs).reshape(-1, len(scale.features)), np.zeros(len(xs)), np.zeros(len(xs), bool),
                np.asarray(of, np.int64))


def joined_rows(parts: Sequence[Rows]) -> Rows:
    return Rows(np.concatenate([r.x for r in parts]), np.concatenate([r.y for r in parts]),
                np.concatenate([r.own for r in parts]), np.concatenate([r.image for r in parts]))


def caption_scores(bundle: Bundle, images: np.ndarray, embedded: Sequence[tuple[np.ndarray, Sequence[object]]]
                   ) -> np.ndarray:
    """(N, L) the S_kl of every image (calibrated fragments (N, F, h)) for every embedded caption."""
    t = max((len(sent) for sent, _ in embedded), default=1) or 1
    sent = np.zeros((len(embedded), t, bundle.dim), np.float32)
    mask = np.zeros((len(embedded), t), np.float32)
    for n, (s, _) in enumerate(embedded):
        sent[n, : len(s)], mask[n, : len(s)] = s, 1
    ones = np.ones(images.shape[:2], np.float32)
    return np.concatenate([bundle.scores(images, ones, sent[c : c + 500], mask[c : c + 500])
                           for c in range(0, len(sent), 500)], axis=1) if len(sent) else np.zeros((len(images), 0))


def auc(scores: np.ndarray, truth: np.ndarray) -> float:
    """The area under the ROC curve (ties count half)."""
    from scipy.stats import rankdata

    pos = truth > 0.5
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if not n1 or not n0:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def balance(rows: Rows) -> np.ndarray:
    """Each row's weight in the fit: present and absent things weigh the same in all (an even prior: `found` says
    how the picture moves the odds from as-likely-as-not), and among the present, own-image things (boxed in
    the picture) as much as the other images' (named by their captions)."""
    absent = rows.y < 0.5
    own, other = rows.own & ~absent, ~rows.own & ~absent
    n = float(absent.sum())
    w = np.ones(len(rows.y))
    if own.any() and other.any():
        w[own], w[other] = n / 2 / own.sum(), n / 2 / other.sum()
    elif (~absent).any():
        w[~absent] = n / (~absent).sum()
    return w


def fit_weights(rows: Rows) -> tuple[tuple[float, ...], float]:
    """The logistic weights of `found` over the rows, weighed by `balance`."""
    from fragsearch.training.relevance import _logistic

    w, _ = _logistic(np.column_stack([rows.x, np.ones(len(rows.y))]), rows.y, weights=balance(rows))
    return tuple(float(v) for v in w[:-1]), float(w[-1])


def measures(scale: PhraseEvidence, rows: Rows) -> dict[str, Any]:
    """AUC of `found`, the share of own-image things found, of absent things not found, and its calibration
    error (equal-width bins)."""
    from fragsearch.training.relevance import calibration_error, reliability

    p = scale.probability(rows.x)
    absent = rows.y < 0.5
    return {"pairs": len(rows.y), "auc": round(auc(p, rows.y), 4),
            "own_found": round(float((p[rows.own] >= FOUND).mean()), 4) if rows.own.any() else None,
            "absent_not_found": round(float((p[absent] < FOUND).mean()), 4) if absent.any() else None,
            "ece": round(calibration_error(reliability(p, rows.y)), 4)}


def word_counts(data: SplitData) -> dict[str, int]:
    """How many pictures of `data` each noun its captions name (`named_things`) is named by."""
    pictures: dict[str, set[int]] = {}
    for p, k in zip(data.parsed, data.pair_image, strict=True):
        for w in named_things(p.triplets):
            pictures.setdefault(w, set()).add(int(k))
    return {w: len(ks) for w, ks in sorted(pictures.items())}


def fit_evidence(bundle: Bundle, val: SplitData, entities: Path, seed: int = 0, rest: SplitData | None = None
                 ) -> tuple[PhraseEvidence, dict[str, Any]]:
    """The evidence weights fitted on `val` (the validation part), with their measures on its held-out half
    (fitted on the other half) and on the whole part (the weights kept). With `rest` (the part the model was
    trained on), `found` also reads how well the model knows each thing's word (`known`, from the pictures of
    `rest` naming it), and the fit sees captions swapped for nouns the model never saw."""
    counts = word_counts(rest) if rest is not None else {}
    features = features_of(bundle.presence, bool(counts))
    base = bundle.evidence_scale(weights=(0.0,) * len(features), intercept=0.0, head=bundle.presence, counts=counts)
    ents = read_entities(entities, val.names) if Path(entities).exists() else {}
    words = image_words(val, ents)
    swapped = swapped_rows(bundle, base, val, words, seed=seed)
    unseen = swapped_rows(bundle, base, val, words, seed=seed + 1, unseen=True) if counts else None
    rows = joined_rows([evidence_rows(bundle, base, val, ents, seed=seed), swapped, *([unseen] if unseen else [])])
    half = np.random.default_rng(seed).random(len(val.names)) < 0.5

    def held_out(r: Rows) -> Rows:
        keep = ~half[r.image]
        return Rows(r.x[keep], r.y[keep], r.own[keep], r.image[keep])

    first = half[rows.image]
    part = Rows(rows.x[first], rows.y[first], rows.own[first], rows.image[first])
    held = PhraseEvidence(*fit_weights(part), base.references, base.blocks, base.head, counts)
    weights, intercept = fit_weights(rows)
    scale = PhraseEvidence(weights, intercept, base.references, base.blocks, base.head, counts)
    report = {"held_out_half": measures(held, held_out(rows)), "fitted": measures(scale, rows),
              "swapped_not_found": measures(held, held_out(swapped))["absent_not_found"],
              **({"unseen_swapped_not_found": measures(held, held_out(unseen))["absent_not_found"]}
                 if unseen is not None else {}),
              "weights": dict(zip(features, weights, strict=True)), "intercept": intercept}
    logger.info("phrase evidence on the validation part: %s", report)
    return scale, report


def pair_terms(bundle: Bundle, scale: PhraseEvidence, data: SplitData) -> Callable[[np.ndarray, np.ndarray],
                                                                                     np.ndarray]:
    """The phrase evidence terms (model/evidence.py `Found.terms`) of (caption, image) pairs of `data`, numbered
    as `data` numbers them: what the relevance fit reads."""
    def terms(captions: np.ndarray, image_ids: np.ndarray) -> np.ndarray:
        # only the images and captions the pairs hold are embedded
        wanted = np.unique(image_ids)
        row = {int(k): n for n, k in enumerate(wanted)}
        images = np.concatenate([bundle.embed_images(data.feats[wanted[k : k + 256]])
                                 for k in range(0, len(wanted), 256)])
        said = np.unique(captions)
        enc = bundle.text.encode_parsed([data.parsed[int(c)] for c in said], [data.sentences[int(c)] for c in said])
        embedded = dict(zip(said.tolist(), embed_encoded(bundle, enc), strict=True))
        out = np.zeros((len(captions), 2))
        order = np.argsort(captions, kind="stable")
        bounds = np.flatnonzero(np.diff(captions[order])) + 1
        for group in tqdm(np.split(order, bounds), desc="evidence of shown pairs", unit="caption"):
            sent, triplets = embedded[int(captions[group[0]])]
            if not len(sent):
                continue
            ev = scale.for_sentence(sent, triplets)
            for n in group:
                out[n] = ev.found(images[row[int(image_ids[n])]]).terms()
        return out

    return terms


def things_named(words: Sequence[set[str]], things: Sequence[Sequence[str]], images: np.ndarray,
                 captions: np.ndarray) -> np.ndarray:
    """(len(images), len(captions)) bool: whether the image's words (`image_words`: its captions' and its Entities
    phrases') name every thing the caption names (`things`, model/evidence.py `named_things`, singular or
    plural); False for a caption that names nothing."""
    images, captions = np.asarray(images), np.asarray(captions)
    holders: dict[str, np.ndarray] = {}
    out = np.zeros((len(images), len(captions)), dtype=bool)
    for j, c in enumerate(captions):
        named = things[int(c)]
        if not named:
            continue
        for w in named:
            if w not in holders:
                holders[w] = np.array([names_in(words[int(k)], w) for k in images], dtype=bool)
        out[:, j] = np.logical_and.reduce([holders[w] for w in named])
    return out


def things_named_of(data: SplitData, ents: Mapping[str, ImageEntities]) -> np.ndarray:
    """(N, L) `things_named` of every image and caption of `data` (the things each caption's parse names)."""
    return things_named(image_words(data, ents), [named_things(p.triplets) for p in data.parsed],
                        np.arange(len(data.names)), np.arange(len(data.sentences)))


def named_alike(judged: Judged, words: Sequence[set[str]], things: Sequence[Sequence[str]]) -> Judged:
    """`judged` with a pair also a match where the image holds every thing the caption names (`things_named`):
    the match a person judges phrase by phrase ("a dog runs through the grass" of any picture of a dog on grass),
    beside the pictures described alike. `words` and `things` are numbered as `judged`'s images and captions."""
    n_all, n_sent = len(judged.search), len(judged.caption_image)
    search = things_named(words, things, np.arange(n_all), np.arange(judged.n_captions))
    annotate = things_named(words, things, np.arange(judged.n_images), np.arange(n_sent))
    return replace(judged, search_matches=judged.search_matches | search,
                   annotate_matches=judged.annotate_matches | annotate)


def fit_relevance_with_evidence(bundle: Bundle, scale: PhraseEvidence, val: SplitData, rest: SplitData,
                                ents: Mapping[str, ImageEntities]) -> Relevance:
    """The relevance scale refitted on the validation part (training/relevance.py `fit_relevance`) with the
    phrase evidence of the pairs its queries show, a pair a match where its captions describe it alike or it holds
    every thing the query names (`named_alike`; `ents`: the Entities annotations of the images)."""
    from fragsearch.model.dataset import SplitData as Data
    from fragsearch.training.relevance import distractors_of, fit_relevance, judge

    others = distractors_of(rest)
    both = Data(val.split, np.concatenate([val.feats, others.feats]), np.concatenate([val.boxes, others.boxes]),
                [*val.sentences, *others.sentences],
                np.concatenate([val.pair_image, others.pair_image + len(val.names)]), [*val.parsed, *others.parsed])
    judged = named_alike(judge(bundle, val, others), [*image_words(val, ents), *image_words(others, ents)],
                         [named_things(p.triplets) for p in both.parsed])
    return fit_relevance(judged, evidence_of=pair_terms(bundle, scale, both))


def refit_evidence(run: Refit, out: Path, relevance_only: bool = False) -> None:
    """Fit `run`'s model's phrase evidence (with its presence head, when it has one) and the relevance on it, on
    the validation part, and write the model to `out` (`relevance_only`: the model's evidence kept, the relevance
    alone refitted)."""
    bundle = run.bundle
    if relevance_only:
        if bundle.evidence is None:
            raise SystemExit(f"{run.command}: the model has no phrase evidence to refit the relevance on")
        scale, report = bundle.evidence, dict(bundle.meta.get("evidence", {}).get("validation", {}))
    else:
        scale, report = fit_evidence(bundle, run.val, run.entities, rest=run.rest)
        bundle.set_evidence(scale)
    relevance = fit_relevance_with_evidence(bundle, scale, run.val, run.rest, run.all_entities())
    logger.info("relevance with evidence: %s", relevance.to_state())
    assert bundle.calibration is not None
    bundle.calibration = replace(bundle.calibration, relevance=relevance)
    bundle.meta["evidence"] = {"validation": report, "command": run.command}
    bundle.save(out)
    logger.info("wrote %s", out)


if __name__ == "__main__":  # `python -m fragsearch.training.evidence`, as the docs write it: the command's alias
    from fragsearch.commands.evidence import main

    main()
