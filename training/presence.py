"""Training the presence head (model/evidence.py ``PresenceHead``): is the thing a phrase names in this picture,
whatever else of the sentence fits it?

Samples are (thing, image) pairs of the images the model was trained on (the validation part is kept for the
epochs and for phrase evidence's fit, training/evidence.py; dev is never read), labelled as phrase evidence
labels them (a picture holds a thing when one of its captions or boxed Entities phrases names it):

- a caption's thing in its own image (when its phrase is boxed there, or the image has no Entities lines);
- the same thing in the pictures a search of the part shows first for the caption (its `SHOWN` best), in the
  best of those that do not hold the thing (a search of a collection that lacks it: the look-alikes) and in
  `OTHERS` pictures drawn at random;
- the caption with its first thing swapped for a noun of the part its picture does not hold ("a dog runs" ->
  "a tractor runs"), in its own picture and in the best the swapped caption finds: the rest of the sentence
  fits, the thing is not there.

The loss is the binary cross-entropy of the pooled score, present and absent weighing the same; the epoch kept
is the one with the best AUC on the same kind of samples from the validation part. The head only ranks:
phrase evidence's logistic fit on the validation part (training/evidence.py, run after it) turns its score
into a probability, and the relevance is refitted on it.

    python -m fragsearch.training.presence --model model/released --out artifacts/models/released-presence --epochs 5

Its command line: fragsearch/commands/presence.py (`python -m fragsearch.training.presence` calls it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData
from fragsearch.model.embed import embed_encoded, embed_texts
from fragsearch.model.entities import ImageEntities
from fragsearch.model.evidence import SCORES, PresenceHead, score_features, thing_direction, thing_members, unit
from fragsearch.model.score import alignment_scores
from fragsearch.training.evidence import auc, caption_scores, image_words, names_in, swapped_captions

logger = logging.getLogger("fragsearch.training.presence")
SHOWN = 5
OTHERS = 10
COLLECTION = 1000
RANK = 128
HIDDEN = 64
EPOCHS = 8
PER_IMAGE = 2
BATCH = 512
LR = 2e-3
WEIGHT_DECAY = 1e-5
OWN, OTHER, SWAPPED = 0, 1, 2


@dataclass
class Samples:
    """(thing, image) pairs: each pair's thing (row of `directions`), image (row of `images`), the thing's
    triplets' score features with each fragment (N, F, len(SCORES)), whether the image holds it, and its kind
    (`OWN`, `OTHER`, `SWAPPED`); the things' directions (D, h) and the images' unit fragments (K, F, h)."""

    thing: np.ndarray
    image: np.ndarray
    scores: np.ndarray
    label: np.ndarray
    kind: np.ndarray
    directions: np.ndarray
    images: np.ndarray

    def __len__(self) -> int:
        return len(self.label)


class _Rows:
    def __init__(self) -> None:
        self.thing: list[int] = []
        self.image: list[int] = []
        self.scores: list[np.ndarray] = []
        self.label: list[float] = []
        self.kind: list[int] = []
        self.directions: list[np.ndarray] = []

    def add(self, sent: np.ndarray, rows: Sequence[int], grid: np.ndarray, chosen: np.ndarray,
            labels: Sequence[float], kinds: Sequence[int]) -> None:
        """One thing (its triplets `rows` of `sent`) in the images `chosen`, whose fragments' scores with every
        triplet are `grid` (len(chosen), F, T)."""
        d = len(self.directions)
        self.directions.append(thing_direction(sent[list(rows)]))
        for n, i in enumerate(chosen):
            self.thing.append(d)
            self.image.append(int(i))
            self.scores.append(score_features(grid[n][:, list(rows)]))
            self.label.append(float(labels[n]))
            self.kind.append(int(kinds[n]))

    def samples(self, images: np.ndarray) -> Samples:
        f, h = images.shape[1], images.shape[2]
        return Samples(np.asarray(self.thing, np.int64), np.asarray(self.image, np.int64),
                       np.asarray(self.scores, np.float32).reshape(-1, f, len(SCORES)),
                       np.asarray(self.label, np.float32), np.asarray(self.kind, np.int8),
                       np.asarray(self.directions, np.float32).reshape(-1, h), images)


def samples_of(bundle: Bundle, data: SplitData, entities: Mapping[str, ImageEntities], per_image: int = 2,
               seed: int = 0) -> Samples:
    """The labelled pairs of `per_image` captions of each of `data`'s pictures (see the module's note)."""
    rng = np.random.default_rng(seed)
    n_img = len(data.names)
    images = np.concatenate([bundle.embed_images(data.feats[k : k + 256]) for k in range(0, n_img, 256)])
    words = image_words(data, entities)
    picked = np.sort(np.concatenate([rng.permutation(np.flatnonzero(data.pair_image == k))[:per_image]
                                     for k in range(n_img)])).astype(np.int64)
    enc = bundle.text.encode_parsed([data.parsed[int(c)] for c in picked], [data.sentences[int(c)] for c in picked])
    embedded = embed_encoded(bundle, enc)
    # what a search shows is read in a collection of `COLLECTION` of the part's pictures (dev's size)
    collection = np.sort(rng.permutation(n_img)[:COLLECTION])
    scores = caption_scores(bundle, images[collection], embedded)  # (len(collection), L)
    holders: dict[str, np.ndarray] = {}

    def holds(w: str) -> np.ndarray:
        if w not in holders:
            holders[w] = np.array([names_in(ws, w) for ws in words])
        return holders[w]

    out = _Rows()
    firsts: list[tuple[int, str]] = []
    for l, (sent, triplets) in enumerate(tqdm(embedded, desc="presence samples", unit="caption")):  # noqa: E741
        if not len(sent):
            continue
        things, members = thing_members(triplets)
        if not things:
            continue
        c = int(picked[l])
        k = int(data.pair_image[c])
        firsts.append((c, things[0]))
        image = entities.get(data.names[k])
        caption = image.match(data.sentences[c]) if image is not None else None
        boxed = (set(things) if image is None else
                 {p.head for p in image.boxed(caption)} if caption is not None else set())
        ranked = collection[np.lexsort((collection, -scores[:, l]))]
        ranked = ranked[ranked != k]
        randoms = rng.choice(n_img, size=min(OTHERS, n_img), replace=False)
        for w, rows in zip(things, members, strict=True):
            held = holds(w)
            others = np.unique(np.concatenate([ranked[:SHOWN], ranked[~held[ranked]][:SHOWN], randoms]))
            others = others[others != k]
            chosen = np.concatenate([[k], others]) if w in boxed else others
            grid = alignment_scores(images[chosen].reshape(-1, images.shape[-1]), sent, bundle.blocks)
            grid = grid.reshape(len(chosen), images.shape[1], -1)
            labels = [1.0 if (w in boxed and n == 0) else float(held[int(i)]) for n, i in enumerate(chosen)]
            kinds = [OWN if int(i) == k else OTHER for i in chosen]
            out.add(sent, rows, grid, chosen, labels, kinds)
    _swapped(bundle, data, images, words, firsts, holds, collection, out, rng)
    return out.samples(np.stack([unit(x) for x in images]))


def _swapped(bundle: Bundle, data: SplitData, images: np.ndarray, words: Sequence[set[str]],
             firsts: Sequence[tuple[int, str]], holds: Any, collection: np.ndarray, out: _Rows,
             rng: np.random.Generator) -> None:
    """The captions with their first thing swapped for a noun their picture does not hold
    (training/evidence.py `swapped_captions`), in their picture and in the best picture of `collection` the
    swapped caption finds."""
    swaps = swapped_captions(data, words, firsts, rng)
    embedded = embed_texts(bundle, [t for _, t, _ in swaps], strict=False)
    scores = caption_scores(bundle, images[collection], embedded)
    for l, ((sent, triplets), (c, _, s)) in enumerate(tqdm(list(zip(embedded, swaps, strict=True)),  # noqa: E741
                                                           desc="swapped samples", unit="caption")):
        things, members = thing_members(triplets)
        if s not in things:
            continue
        k = int(data.pair_image[c])
        rows = members[things.index(s)]
        top = collection[np.lexsort((collection, -scores[:, l]))[:2]]
        chosen = np.unique(np.concatenate([[k], top]))
        grid = alignment_scores(images[chosen].reshape(-1, images.shape[-1]), sent, bundle.blocks)
        grid = grid.reshape(len(chosen), images.shape[1], -1)
        held = holds(s)
        out.add(sent, rows, grid, chosen, [float(held[int(i)]) for i in chosen], [SWAPPED] * len(chosen))


def weights_of(samples: Samples) -> np.ndarray:
    """Each pair's weight: present and absent weigh the same in all."""
    pos = samples.label > 0.5
    w = np.ones(len(samples), np.float32)
    if pos.any() and (~pos).any():
        w[pos] = (~pos).sum() / pos.sum()
    return w


def presence_of(head: PresenceHead, samples: Samples) -> np.ndarray:
    """(N,) the head's pooled score of every pair, as the runtime computes it (one pair at a time)."""
    return np.asarray([head.presence(samples.directions[samples.thing[n : n + 1]], samples.images[samples.image[n]],
                                     samples.scores[n : n + 1])[0] for n in range(len(samples))], np.float64)


def measures_of(score: np.ndarray, samples: Samples) -> dict[str, Any]:
    """AUC over every pair, over the pairs a search shows (own image against the look-alikes), and how often a
    swapped thing scores below its caption's own things' median own-image score."""
    out: dict[str, Any] = {"pairs": len(samples), "auc": round(auc(score, samples.label), 4)}
    for name, kind in (("own_vs_other", OTHER), ("own_vs_swapped", SWAPPED)):
        rows = (samples.kind == OWN) | ((samples.kind == kind) & (samples.label < 0.5))
        out[name] = round(auc(score[rows], samples.label[rows]), 4)
    return out


def fit_presence(train: Samples, val: Samples, rank: int = RANK, hidden: int = HIDDEN, epochs: int = EPOCHS,
                 seed: int = 0, batch: int = BATCH) -> tuple[PresenceHead, dict[str, Any]]:
    """The head trained on `train`, at the epoch with the best AUC on `val`, with its measures."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    h = train.images.shape[-1]
    p, q = torch.nn.Linear(h, rank, bias=False), torch.nn.Linear(h, rank, bias=False)
    first, last = torch.nn.Linear(3 * rank + len(SCORES), hidden), torch.nn.Linear(hidden, 1)
    params = [*p.parameters(), *q.parameters(), *first.parameters(), *last.parameters()]
    opt = torch.optim.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY)
    images, directions = torch.from_numpy(train.images), torch.from_numpy(train.directions)
    weights = torch.from_numpy(weights_of(train))

    def current() -> PresenceHead:
        return PresenceHead(p.weight.detach().numpy().copy(), q.weight.detach().numpy().copy(),
                            first.weight.detach().numpy().copy(), first.bias.detach().numpy().copy(),
                            last.weight.detach().numpy()[0].copy(), float(last.bias.detach().numpy()[0]))

    def pooled(a: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x = torch.cat([a[:, None, :] * c, a[:, None, :].expand_as(c), c, s], dim=-1)
        return torch.logsumexp(last(torch.relu(first(x))).squeeze(-1), dim=1)

    def evaluate(samples: Samples) -> np.ndarray:
        out = []
        with torch.no_grad():
            for start in range(0, len(samples), 4096):
                sl = slice(start, start + 4096)
                a = p(torch.from_numpy(samples.directions[samples.thing[sl]]))
                c = q(torch.from_numpy(samples.images[samples.image[sl]]))
                out.append(pooled(a, c, torch.from_numpy(samples.scores[sl])).numpy())
        return np.concatenate(out).astype(np.float64) if out else np.zeros(0)

    best: tuple[float, int, PresenceHead] = (-1.0, -1, current())
    history = []
    for epoch in range(epochs):
        order = rng.permutation(len(train))
        total = 0.0
        for start in tqdm(range(0, len(order), batch), desc=f"presence epoch {epoch + 1}", unit="batch",
                          leave=False):
            rows = torch.from_numpy(order[start : start + batch])
            a = p(directions[torch.from_numpy(train.thing)[rows]])
            c = q(images[torch.from_numpy(train.image)[rows]])
            logit = pooled(a, c, torch.from_numpy(train.scores)[rows])
            y = torch.from_numpy(train.label)[rows]
            loss = (torch.nn.functional.binary_cross_entropy_with_logits(logit, y, reduction="none")
                    * weights[rows]).sum() / weights[rows].sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(rows)
        m = measures_of(evaluate(val), val)
        history.append({"epoch": epoch + 1, "loss": round(total / max(len(train), 1), 4), **m})
        logger.info("presence epoch %d: loss %.4f, validation %s", epoch + 1, total / max(len(train), 1), m)
        if m["auc"] > best[0]:
            best = (m["auc"], epoch + 1, current())
    score, epoch, head = best
    report = {"epoch": epoch, "val_auc": score, "val_pairs": len(val), "train_pairs": len(train),
              "history": history}
    return PresenceHead(head.p, head.q, head.w1, head.b1, head.w2, head.b2, {"validation": report}), report


if __name__ == "__main__":  # `python -m fragsearch.training.presence`, as the docs write it: the command's alias
    from fragsearch.commands.presence import main

    main()
