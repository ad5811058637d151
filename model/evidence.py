"""Phrase evidence: for each thing a sentence names and each image, `found`, the probability that the thing is
in the picture.

A sentence's fragments are triplets; the things it names are its nouns (`named_things`: the words that head a
determiner or modifier, or stand as a subject, an object or a preposition's object; a lone ``<word>`` fragment
names its word). A thing is looked for through every triplet that holds it: "a dog runs" looks for the dog
through ``det(dog, a)`` and ``nsubj(runs, dog)``.

How well a triplet fits an image is its best region's alignment score (model/score.py
``alignment_scores``: the score by which the alignment picks that region). That number alone says little: a
triplet of common words fits every image a little, a rare one fits nothing well. So it is read against the
same triplet's best region in each of `REFERENCES` reference images (training images, stored with the
calibration; the typical image of the collection the model was trained for): where the image stands among
them (`percentile`) and how many spreads above their mean (`standing`). A thing found in a picture stands
out of the typical images through at least one of its triplets; a giraffe in a field of dogs does not.

    found = 1 / (1 + exp(-(w . [max z, mean z, max logit q, mean logit q] + intercept)))

over the thing's triplets, z their standings and q their percentiles. Those say how well the thing's triplets
fit, not whether the thing is there: "a giraffe runs through the grass" fits a dog running on grass through its
verb and its grass. A model with a presence head (`PresenceHead`, trained by training/presence.py on the
pictures a search shows that lack a thing and on captions with a thing swapped for one the picture does not
hold) adds its score to the features:

    found = 1 / (1 + exp(-(w . [max z, mean z, max logit q, mean logit q, presence] + intercept)))

A model fitted with the word counts of the part it was trained on (`PhraseEvidence.counts`: how many of those
pictures' captions name each noun) also reads how well it knows the thing's word, `known` = log(1 + count). A
word no training caption used ("a giraffe", in a collection of dogs) has no picture behind it: however well
"runs through the grass" fits, the model has nothing to have found it by.

The weights are fitted on the validation part of the training images (training/evidence.py), never dev: a
phrase of a caption with a Flickr30k Entities box in its own image is present; in another image it is present
when one of that image's captions or boxed phrases names the same word, absent when none does; a caption's
thing swapped for a noun its picture does not hold is absent there (a noun of the training captions, and, with
`known`, a noun of the validation part's captions that no caption of the part trained on uses).

`PhraseEvidence` holds the fitted weights; `PhraseEvidence.for_sentence` reads one sentence's triplets against
the references once (`SentenceEvidence`), and `SentenceEvidence.found` gives each thing's and each triplet's
probability in any image (a search's results, an annotation's upload, one explanation). One implementation
for search, annotation, explanation, region search and the command line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fragsearch.model.fragments import SENTENCE_REL, WORD_REL
from fragsearch.model.score import alignment_scores
from fragsearch.model.text import Triplet

EVIDENCE_FORM = "evidence-1"  # a stored evidence scale's form (an earlier one is not read: refit it)
REFERENCES = 300  # reference images a sentence's triplets are read against
FOUND = 0.5  # a thing is reported found (its region drawn) when its probability reaches this
CLIP = 8.0  # log-odds are clipped to +-CLIP (a probability between 0.0003 and 0.9997)
SCORES = ("max_score", "mean_score", "standing")  # what a thing's triplets' scores with a fragment say of it
EPS = 1e-6

# relations whose first word is the thing (its determiner, modifier, count, owner)
THING_FIRST = frozenset({"det", "amod", "nummod", "num", "poss", "predet", "quantmod", "compound", "nn", "det_predet"})
# relations whose second word is the thing (subject, object, a preposition's object, an apposition)
THING_SECOND = frozenset({"nsubj", "nsubjpass", "nsubj_pass", "dobj", "obj", "iobj", "agent", "pobj", "appos",
                          "compound", "nn", "poss"})
THING_SECOND_PREFIXES = ("prep_", "nmod", "obl")
# nouns that name a place in the picture or the picture itself, not a thing in it
NOT_THINGS = frozenset({"front", "top", "side", "middle", "background", "foreground", "edge", "bottom", "center",
                        "centre", "picture", "photo", "image", "shot", "view", "way", "day", "time", "lot", "bunch",
                        "kind", "sort", "type", "part", "end", "left", "right", "one", "ones", "something",
                        "someone", "it", "each", "other", "another", "air", "distance"})


def forms(word: str) -> set[str]:
    """A noun's singular and plural spellings, as far as simple English endings go."""
    out = {word, word + "s", word + "es"}
    if word.endswith("ies"):
        out.add(word[:-3] + "y")
    if word.endswith("es"):
        out.add(word[:-2])
    if word.endswith("s"):
        out.add(word[:-1])
    if word.endswith("y"):
        out.add(word[:-1] + "ies")
    if word.endswith("man"):
        out.add(word[:-3] + "men")
    if word.endswith("men"):
        out.add(word[:-3] + "man")
    return out


def known(thing: str, counts: Mapping[str, int]) -> float:
    """How well the model knows a thing's word: log(1 + the pictures of the part it was trained on whose captions
    name it, in any of its `forms`); 0 for a word it never saw."""
    return float(np.log1p(max((counts.get(f, 0) for f in forms(thing)), default=0)))


def unit(x: np.ndarray) -> np.ndarray:
    """Rows of `x` scaled to unit length (a zero row stays zero)."""
    x = np.asarray(x, dtype=np.float32)
    return np.asarray(x / (np.linalg.norm(x, axis=-1, keepdims=True) + EPS), dtype=np.float32)


def score_features(grid: np.ndarray) -> np.ndarray:
    """(..., F, len(SCORES)) a thing's triplets scored with each fragment of an image: `grid` (..., F, m), their
    `alignment_scores` (the leading axes: several images of as many fragments)."""
    a = np.asarray(grid, dtype=np.float32)
    best = a.max(axis=-1)
    standing = (best - best.mean(axis=-1, keepdims=True)) / (best.std(axis=-1, keepdims=True) + EPS)
    return np.stack([best, a.mean(axis=-1), standing], axis=-1).astype(np.float32)


def thing_direction(rows: np.ndarray) -> np.ndarray:
    """(h,) a thing's direction: the unit mean of its triplets' unit vectors (rows (m, h))."""
    return unit(unit(rows).mean(axis=0))


def second_is_thing(rel: str) -> bool:
    """Whether a relation's second word is the thing (a subject, an object, a preposition's object)."""
    return rel in THING_SECOND or rel.startswith(THING_SECOND_PREFIXES)


def named_things(triplets: Sequence[Triplet]) -> list[str]:
    """The things a sentence names, in the order its triplets first name them: the first word of a
    `THING_FIRST` relation, the second of a `THING_SECOND` one (or a preposition's), a lone word's word; leaving
    out `NOT_THINGS` and words that are not words (numbers, punctuation)."""
    out: list[str] = []
    for t in triplets:
        words = ([t.w1] if t.rel == WORD_REL else
                 [*([t.w1] if t.rel in THING_FIRST else []), *([t.w2] if second_is_thing(t.rel) else [])])
        for w in words:
            if w.isalpha() and w not in NOT_THINGS and w not in out:
                out.append(w)
    return out


def things_of(triplet: Triplet, things: Sequence[str]) -> list[str]:
    """Which of the sentence's `things` one of its triplets holds (none for the whole-sentence fragment)."""
    if triplet.rel == SENTENCE_REL:
        return []
    return [w for w in things if w in (triplet.w1, triplet.w2)]


def thing_members(triplets: Sequence[Triplet]) -> tuple[list[str], list[list[int]]]:
    """The sentence's things (`named_things`) that a triplet holds, each with the rows of the triplets that
    hold it."""
    things = named_things(triplets)
    members = [[j for j, t in enumerate(triplets) if w in things_of(t, things)] for w in things]
    keep = [n for n, m in enumerate(members) if m]
    return [things[n] for n in keep], [members[n] for n in keep]


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1 - 1e-6)
    return np.asarray(np.clip(np.log(p) - np.log1p(-p), -CLIP, CLIP))


def _probability(z: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0))))


FEATURES = ("max_standing", "mean_standing", "max_percentile", "mean_percentile")


@dataclass(frozen=True)
class Standing:
    """Where fragments' best-region scores stand among the references: z (standing) and logit q (percentile),
    both (..., T)."""

    z: np.ndarray
    q: np.ndarray


def thing_features(st: Standing, members: Sequence[Sequence[int]]) -> np.ndarray:
    """(..., n_things, len(FEATURES)): each thing's features over its triplets (`members`: the fragment rows of
    each thing), from the fragments' standings (..., T)."""
    out = np.zeros((*st.z.shape[:-1], len(members), len(FEATURES)))
    for n, rows in enumerate(members):
        z, q = st.z[..., list(rows)], st.q[..., list(rows)]
        out[..., n, :] = np.stack([z.max(-1), z.mean(-1), q.max(-1), q.mean(-1)], axis=-1)
    return out


def summary_of(state: Mapping[str, Any]) -> dict[str, Any]:
    """A head's state without its per-epoch histories (what a release's manifest records)."""
    return {k: ({kk: vv for kk, vv in v.items() if kk != "history"} if isinstance(v, Mapping) else v)
            for k, v in state.items()}


PRESENCE_FORM = "presence-1"  # a stored presence head's form (an earlier one is not read: retrain it)


def pool(scores: np.ndarray) -> np.ndarray:
    """(...) the log-sum-exp of fragment scores (..., F): a smooth largest, what the presence head says of the
    image."""
    s = np.asarray(scores, dtype=np.float64)
    top = s.max(axis=-1, keepdims=True)
    return np.asarray((top + np.log(np.exp(s - top).sum(axis=-1, keepdims=True)))[..., 0])


@dataclass(frozen=True)
class PresenceHead:
    """A head trained to tell whether the thing a direction names is in an image, whatever else fits: each
    fragment gets a score from one hidden layer (ReLU) over [(P s) * (Q v), P s, Q v, scores] (s the thing's
    direction, v the fragment's unit vector, `SCORES` its triplets' alignment scores there), and the image's
    is their log-sum-exp (`pool`). Trained on the training images with the pictures a search shows that lack
    the thing and captions with a thing swapped for one the picture does not hold (training/presence.py);
    phrase evidence reads it beside the references' standings.

    p, q (r, h); w1 (H, 3r + len(SCORES)), b1 (H,), w2 (H,), b2."""

    p: np.ndarray = field(repr=False)
    q: np.ndarray = field(repr=False)
    w1: np.ndarray = field(repr=False)
    b1: np.ndarray = field(repr=False)
    w2: np.ndarray = field(repr=False)
    b2: float = 0.0
    state: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def rank(self) -> int:
        return int(self.p.shape[0])

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"p": self.p, "q": self.q, "w1": self.w1, "b1": self.b1, "w2": self.w2,
                "b2": np.asarray([self.b2], np.float32)}

    def to_state(self) -> dict[str, Any]:
        return {**self.state, "form": PRESENCE_FORM, "rank": self.rank, "hidden": int(self.w1.shape[0]),
                "scores": list(SCORES)}

    def summary(self) -> dict[str, Any]:
        return summary_of(self.to_state())

    @classmethod
    def from_parts(cls, state: dict[str, Any] | None, arrays: dict[str, np.ndarray]) -> PresenceHead | None:
        """The stored head (None: none stored, or of another form)."""
        if not state or state.get("form") != PRESENCE_FORM or "p" not in arrays:
            return None
        p, q, w1 = (np.asarray(arrays[k], np.float32) for k in ("p", "q", "w1"))
        if p.shape != q.shape or w1.ndim != 2 or w1.shape[1] != 3 * p.shape[0] + len(SCORES):
            raise ValueError(f"the presence head's arrays have shapes {p.shape}, {q.shape}, {w1.shape}: "
                             "not [(P s) * (Q v), P s, Q v, scores]")
        return cls(p, q, w1, np.asarray(arrays["b1"], np.float32), np.asarray(arrays["w2"], np.float32),
                   float(np.asarray(arrays["b2"]).reshape(-1)[0]), dict(state))

    def for_things(self, directions: np.ndarray) -> HeadTerms:
        """What the head reads of the things alone (`directions` (N, h)), once per sentence."""
        r, hidden = self.rank, int(self.w1.shape[0])
        a = np.asarray(directions, np.float32) @ self.p.T  # (N, r)
        # a fragment's projection's weights per thing: its product with the thing's and its own term, folded with Q
        by_thing = self.w1[None, :, :r] * a[:, None, :] + self.w1[None, :, 2 * r : 3 * r]  # (N, H, r)
        fold = np.ascontiguousarray(self.q.T @ by_thing.reshape(-1, r).T, dtype=np.float32)  # (h, N H)
        bias = (a @ self.w1[:, r : 2 * r].T + self.b1).astype(np.float32)  # (N, H)
        return HeadTerms(fold, bias.reshape(len(a), hidden))

    def fragment_scores(self, directions: np.ndarray, fragments: np.ndarray, scores: np.ndarray,
                        terms: HeadTerms | None = None) -> np.ndarray:
        """(N, F) each thing's score in each fragment: `directions` (N, h) the things' (or their `terms`, read
        once), `fragments` (F, h) unit fragment vectors, `scores` (N, F, len(SCORES)) their `score_features`."""
        terms = self.for_things(directions) if terms is None else terms
        n_things, hidden = terms.bias.shape
        n_frag = len(fragments)
        x = (np.asarray(fragments, np.float32) @ terms.fold).reshape(n_frag, n_things, hidden).transpose(1, 0, 2)
        x = x + np.asarray(scores, np.float32) @ self.w1[:, 3 * self.rank :].T + terms.bias[:, None, :]
        np.maximum(x, 0.0, out=x)
        return np.asarray(x @ self.w2 + self.b2, dtype=np.float32)

    def presence(self, directions: np.ndarray, fragments: np.ndarray, scores: np.ndarray,
                 terms: HeadTerms | None = None) -> np.ndarray:
        """(N,) what the head says of each thing in the image (`pool` of `fragment_scores`)."""
        return pool(self.fragment_scores(directions, fragments, scores, terms))


@dataclass(frozen=True)
class HeadTerms:
    """The presence head's terms of a sentence's things: the fragment vector's weights folded per thing (h, N H)
    and each thing's own term with the layer's bias (N, H)."""

    fold: np.ndarray
    bias: np.ndarray


@dataclass(frozen=True)
class PhraseEvidence:
    """The fitted weights of `found` (over `features_of(head)`), the reference images' fragments its triplets are
    read against ((R, F, h), calibrated as the collection's images are) and the presence head, when the model
    has one."""

    weights: tuple[float, ...]
    intercept: float
    references: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros((0, 0, 0)))
    blocks: int = 1
    head: PresenceHead | None = field(default=None, repr=False, compare=False)
    counts: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)  # pictures naming each word

    @property
    def features(self) -> tuple[str, ...]:
        return features_of(self.head, bool(self.counts))

    def to_state(self) -> dict[str, Any]:
        return {"form": EVIDENCE_FORM, "weights": list(self.weights), "intercept": self.intercept,
                "features": list(self.features), **({"counts": dict(sorted(self.counts.items()))}
                                                      if self.counts else {})}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, references: np.ndarray, blocks: int,
                   head: PresenceHead | None = None) -> PhraseEvidence | None:
        """The stored weights with the references and the model's presence head (None: none stored, of an earlier
        form, or fitted with a head the model does not have: refit them with training.evidence)."""
        if not state or state.get("form") != EVIDENCE_FORM:
            return None
        features = tuple(state.get("features", ()))
        counts = {str(w): int(n) for w, n in dict(state.get("counts", {})).items()}
        if features == features_of(None, bool(counts)):
            head = None
        elif features != features_of(head, bool(counts)):
            return None
        return cls(tuple(float(w) for w in state["weights"]), float(state["intercept"]),
                   np.asarray(references[:REFERENCES], dtype=np.float32), blocks, head, counts)

    def reference_best(self, sent: np.ndarray) -> np.ndarray:
        """(R, T) each reference image's best region score for each sentence fragment (sent (T, h))."""
        r, f, h = self.references.shape
        scores = alignment_scores(self.references.reshape(r * f, h), sent, self.blocks)  # (R F, T)
        return np.asarray(scores.reshape(r, f, -1).max(axis=1), dtype=np.float64)

    def for_sentence(self, sent: np.ndarray, triplets: Sequence[Triplet]) -> SentenceEvidence:
        """One sentence's fragments (T, h) and triplets, read against the references once."""
        sent = np.asarray(sent, dtype=np.float32)
        ref = np.sort(self.reference_best(sent), axis=0)  # (R, T) ascending
        things, members = thing_members(triplets)
        directions = (np.stack([thing_direction(sent[m]) for m in members]) if members
                      else np.zeros((0, sent.shape[-1] if sent.ndim == 2 else 0), np.float32))
        return SentenceEvidence(self, sent, list(triplets), things, members, ref, ref.mean(axis=0),
                                ref.std(axis=0) + 1e-6, directions,
                                None if self.head is None or not things else self.head.for_things(directions),
                                np.asarray([known(w, self.counts) for w in things], dtype=np.float64))

    def probability(self, features: np.ndarray) -> np.ndarray:
        """found from `SentenceEvidence.features`' (..., len(self.features))."""
        return _probability(features @ np.asarray(self.weights) + self.intercept)


def features_of(head: PresenceHead | None, counted: bool = False) -> tuple[str, ...]:
    """What `found` reads: the references' standings, the presence head's score when there is one, and how well
    the model knows the thing's word (`known`) when the pictures naming each word are `counted`."""
    return (*FEATURES, *(("presence",) if head is not None else ()), *(("known",) if counted else ()))


@dataclass(frozen=True)
class Found:
    """A sentence's evidence in one image: each thing's probability (`things`, in `SentenceEvidence.things`
    order) and each fragment's (the least of the things it holds; None for a fragment that holds none)."""

    things: dict[str, float]
    fragments: list[float | None]

    @property
    def missing(self) -> list[str]:
        """The things not found (below `FOUND`), least likely first."""
        return [w for w, p in sorted(self.things.items(), key=lambda kv: (kv[1], kv[0])) if p < FOUND]

    @property
    def weakest(self) -> float | None:
        """The least likely thing's probability (None: the sentence names none)."""
        return min(self.things.values()) if self.things else None

    def terms(self) -> np.ndarray:
        """(2,) what the relevance scale reads of it (model.calibration.Relevance): the logit of the weakest
        thing's probability and the mean logit of all; (0, 0) for a sentence that names nothing."""
        return evidence_terms(list(self.things.values()))


def evidence_terms(found: Sequence[float]) -> np.ndarray:
    """(2,) the logit of the least of the `found` probabilities and their mean logit ((0, 0) for none)."""
    if not len(found):
        return np.zeros(2)
    z = logit(np.asarray(found, dtype=np.float64))
    return np.asarray([z.min(), z.mean()])


@dataclass(frozen=True)
class SentenceEvidence:
    """One sentence read against the references: its things, the fragment rows of each, the references' best
    scores per fragment (sorted, (R, T)) with their mean and spread, and the things' directions (N, h)."""

    scale: PhraseEvidence
    sent: np.ndarray
    triplets: list[Triplet]
    things: list[str]
    members: list[list[int]]
    reference: np.ndarray
    mean: np.ndarray
    spread: np.ndarray
    directions: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0), np.float32))
    head_terms: HeadTerms | None = field(repr=False, default=None)
    known: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))  # (N,) `known` of each thing

    def standing(self, best: np.ndarray) -> Standing:
        """Standings of best-region scores (..., T)."""
        best = np.asarray(best, dtype=np.float64)
        r = self.reference.shape[0]
        below = np.stack([np.searchsorted(self.reference[:, j], best[..., j], side="left")
                          for j in range(best.shape[-1])], axis=-1) if best.shape[-1] else np.zeros(best.shape)
        at = np.stack([np.searchsorted(self.reference[:, j], best[..., j], side="right")
                       for j in range(best.shape[-1])], axis=-1) if best.shape[-1] else np.zeros(best.shape)
        q = ((below + at) / 2 + 0.5) / (r + 1)
        return Standing((best - self.mean) / self.spread, logit(q))

    def best_in(self, img: np.ndarray) -> np.ndarray:
        """(T,) each fragment's best region score in one image's fragments (F, h)."""
        return np.asarray(alignment_scores(img, self.sent, self.scale.blocks).max(axis=0), dtype=np.float64)

    def features(self, img: np.ndarray) -> np.ndarray:
        """(N, len(scale.features)) what `found` reads of each thing in one image (its fragments (F, h))."""
        return self.features_of(np.asarray(img, np.float32)[None])[0]

    def features_of(self, imgs: np.ndarray) -> np.ndarray:
        """(K, N, len(scale.features)) what `found` reads of each thing in each of K images of as many fragments
        (imgs (K, F, h)): one product for all of them, each image read on its own."""
        imgs = np.asarray(imgs, np.float32)
        k, f, h = imgs.shape
        grid = np.asarray(alignment_scores(imgs.reshape(k * f, h), self.sent, self.scale.blocks)
                          ).reshape(k, f, -1)  # (K, F, T)
        out = thing_features(self.standing(grid.max(axis=1).astype(np.float64)), self.members)  # (K, N, 4)
        head = self.scale.head
        if head is not None and self.things:
            scores = np.stack([score_features(grid[:, :, rows]) for rows in self.members])  # (N, K, F, S)
            each = head.fragment_scores(self.directions, unit(imgs.reshape(k * f, h)),
                                        scores.reshape(len(self.things), k * f, -1), self.head_terms)
            presence = pool(each.reshape(len(self.things), k, f)).T  # (K, N)
            out = np.concatenate([out, presence[..., None]], axis=-1)
        if self.scale.counts and self.things:
            out = np.concatenate([out, np.broadcast_to(self.known, (k, len(self.things)))[..., None]], axis=-1)
        return out

    def found(self, img: np.ndarray) -> Found:
        """The evidence in one image (its fragments (F, h), calibrated as stored)."""
        return self.found_in(np.asarray(img, np.float32)[None])[0]

    def found_in(self, imgs: np.ndarray) -> list[Found]:
        """The evidence in each of K images of as many fragments (imgs (K, F, h), calibrated as stored)."""
        if not self.things:
            return [Found({}, [None] * len(self.triplets)) for _ in range(len(imgs))]
        out = []
        for p in self.scale.probability(self.features_of(imgs)):
            things = {w: float(v) for w, v in zip(self.things, p, strict=True)}
            fragments: list[float | None] = []
            for j in range(len(self.triplets)):
                held = [things[w] for w, rows in zip(self.things, self.members, strict=True) if j in rows]
                fragments.append(min(held) if held else None)
            out.append(Found(things, fragments))
        return out
