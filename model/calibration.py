"""Score calibration, the data every checkpoint load needs: each item's fragments are scaled so that
its S_kl against a fixed reference set has unit spread.

S_kl is positively homogeneous in either side's fragments (max(0, c v.s) = c max(0, v.s) for c > 0), so
dividing image k's fragments by sigma_k and sentence l's by tau_l gives S_kl / (sigma_k tau_l): still the
one S_kl (model.score.skl), of the calibrated fragments. sigma_k is the standard deviation of image k's
S_kl against R reference training sentences, tau_l that of sentence l against R reference training images.

Why: without it a few images score high against almost every sentence (hubs) and crowd the top of
image search. For a fixed image, sigma_k does not change how its sentences rank, and for a fixed
sentence tau_l does not change how its images rank: the image scale acts on search only, the
sentence scale on annotation only, and neither changes which region a triplet aligns to. The
reference sets are drawn from the training split and stored, embedded, in the checkpoint; the scale
of a new image or sentence is computed from its own fragments when it is embedded. (In the
retrieval literature: querybank normalisation, a remedy for hubness.)

A local scale (`local_k`, `local_power`; `Calibration.localised`, chosen on the validation part by
training/calibrate.py) divides each item further by m^p, m the mean of its `local_k` best calibrated scores
against the references, summed over a merged model's blocks as the score is: the spread says how widely an
item's scores vary, m how close it comes to its nearest references, so an item near many (a hub) is scaled
down by more than its spread says (cross-domain local scaling, CSLS, in its multiplicative form). Still a
positive per-item factor: the same S_kl, one side's factor leaving the other side's rankings and every
alignment alone, and nothing more to compute per query than the scores against the references the spread
needs. The references' own spreads it uses (`ref_image_scales`, `ref_sentence_scales`) are stored with them.

The relevance scale (`Relevance`) maps a calibrated S_kl to a number a person can read: the
probability that a person would call the result a match for the query, in the collection being searched.
What makes a result likely a match is its score, how far it stands out of the collection for that query (the
best of many close results is less likely the one than a result far ahead of the rest) and how many items the
collection holds (the more there are, the more can look the part without being it). So the scale reads the
query's best scores in the collection (`for_query`: the ranking's best `RELEVANCE_TOP` + 1, which every search
computes exactly) and the collection's size N, and for a result of score S

    x = beta S - log sum_j exp(beta S_j)      over the `RELEVANCE_TOP` best other items (`competition`)
    relevance = 1 / (1 + exp(-(slope S + context x + size of the side * log N + intercept of the side)))

x is the log-odds that the result is the one among them, as a softmax over the collection says; a
collection with fewer items counts the missing ones at a typical score (`pad`). slope, context >= 0, so for
one query the relevance is a monotone map of S_kl and never changes a ranking. The numbers are fitted on the
validation part of the training data (never dev): its queries against collections of its items and of the
other training items beside them, from a hundred to thousands of images (training/relevance.py
`fit_relevance`; a pair a match when the picture's captions describe it alike, and for a scale that reads the
phrase evidence also when the picture holds every thing the query names: training/evidence.py `named_alike`),
and stored beside the reference sets; a checkpoint without a scale (made before it existed,
an uncalibrated model, or one whose scale has an earlier form) serves scores without a relevance.

The scales are computed with the one S_kl (model/score.py), on NumPy arrays in the service and on torch
tensors in training alike (the array API: model/arrays.py). Fitting the references, timing them and the
command line are training/calibrate.py's; fitting the relevance, training/relevance.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from array_api_compat import device as array_device

from fragsearch.model.arrays import Array, contiguous, namespace, to_numpy
from fragsearch.model.product import QuantizedRows, quantizes
from fragsearch.model.score import block_slices, skl

BLOCK = 200  # items of the other side scored per step (bounds memory: BLOCK * F x R * T products)


DEFAULT_CUTOFF = 0.5  # relevance at which a match is as likely as not: below it, "no good match"
RELEVANCE_TOP = 100  # the best other items of a query's collection its relevance compares a result with
RELEVANCE_FORM = "context-2"  # a stored relevance scale's form (an earlier one is not read: refit it)
EVIDENCE_RELEVANCE_FORM = "evidence-1"  # the same with the phrase evidence's terms (`Relevance.evidence`)


def _exp(z: np.ndarray) -> np.ndarray:
    return np.exp(np.clip(z, -60.0, 60.0))


def probability(z: np.ndarray) -> np.ndarray:
    """The logistic function of log-odds z."""
    return np.asarray(1.0 / (1.0 + _exp(-np.asarray(z, dtype=np.float64))))


def competition(best: np.ndarray, scores: np.ndarray, beta: float, top: int, pad: float) -> np.ndarray:
    """How far each score stands out of its query's collection: x = beta S - log sum_j exp(beta S_j) over the
    `top` best other items of the collection, a collection with fewer counted as holding the rest at score `pad`
    (the log-odds that the item is the one among them, as a softmax over the collection would say).

    best: (Q, m) each of Q queries' best scores in its collection, best first (m >= top + 1 holds every other
    item an item among them needs; -inf where a collection has fewer); scores: (Q, n) the scores to place,
    each an item of its query's collection (an item is among `best` when its score reaches the last listed
    one, and is then left out of its own sum). Increasing in each score for a given query. (Q, n) float64."""
    b = np.asarray(best, dtype=np.float64)[:, : top + 1]
    s = np.asarray(scores, dtype=np.float64)
    have = np.isfinite(b).sum(axis=1)  # (Q,)
    finite = np.where(np.isfinite(b), b, -np.inf)
    shift = np.maximum(np.maximum(finite.max(axis=1, initial=-np.inf), pad), s.max(axis=1, initial=-np.inf))
    e = np.where(np.isfinite(b), np.exp(beta * (finite - shift[:, None])), 0.0)
    listed = np.minimum(have, top + 1)
    last = np.where(listed > 0, b[np.arange(len(b)), np.maximum(listed - 1, 0)], np.inf)
    inside = s >= last[:, None]
    own = np.exp(beta * (s - shift[:, None]))
    others = np.where(inside, e.sum(axis=1)[:, None] - own, e[:, :top].sum(axis=1)[:, None])
    count = np.where(inside, (listed - 1)[:, None], np.minimum(have, top)[:, None])
    others = np.maximum(others, 0.0) + (top - count) * np.exp(beta * (pad - shift))[:, None]
    return np.asarray(beta * (s - shift[:, None]) - np.log(np.maximum(others, 1e-300)))


SIDES = ("search", "annotate")  # images for a sentence; sentences for an image


@dataclass(frozen=True)
class Relevance:
    """relevance = 1 / (1 + exp(-z)), z = slope * S + context * x + size of the side * log N + intercept of the
    side, x the score's `competition` in its query's collection of N items: the probability that a person calls
    a result with calibrated score S a match, for the collection searched (`for_query`: the query's best scores
    there and the collection's size). slope >= 0 and context >= 0, so for one query it ranks as S does."""

    slope: float
    context: float
    beta: float
    search_intercept: float
    annotate_intercept: float
    pad: float  # the score of the competitors a collection of fewer than `top` other items lacks
    search_size: float = 0.0  # log-odds per log of the items a search ranks
    annotate_size: float = 0.0
    top: int = RELEVANCE_TOP
    evidence: tuple[float, float] = (0.0, 0.0)  # log-odds per logit of the weakest and of the mean thing found
    side: str = "search"  # the query's side (SIDES)
    best: tuple[float, ...] = ()  # the query's best `top` + 1 scores in the collection, best first
    items: int = 1  # the items of the query's collection

    def for_query(self, side: str, scores: np.ndarray | list[float], items: int | None = None) -> Relevance:
        """This scale for one query of `side` whose collection of `items` items (None: as many as `scores`)
        scores `scores` (any order; at least the best `top` + 1 of them, or all the collection's)."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, not {side!r}")
        s = np.asarray(scores, dtype=np.float64).reshape(-1)
        s = s[np.isfinite(s)]
        keep = -np.sort(-s)[: self.top + 1] if len(s) else s
        n = len(s) if items is None else int(items)
        return replace(self, side=side, best=tuple(float(v) for v in keep), items=max(1, n, len(keep)))

    @property
    def uses_evidence(self) -> bool:
        """Whether the scale reads the phrase evidence (a scale fitted with it, model/evidence.py)."""
        return any(w != 0.0 for w in self.evidence)

    def log_odds(self, score: float | np.ndarray, evidence: np.ndarray | None = None) -> np.ndarray:
        s = np.asarray(score, dtype=np.float64)
        best = np.full((1, self.top + 1), -np.inf)
        best[0, : len(self.best)] = self.best
        x = competition(best, s.reshape(1, -1), self.beta, self.top, self.pad).reshape(s.shape)
        return self.log_odds_of(s, x, np.asarray(self.side == "search"), np.asarray(self.items), evidence)

    def log_odds_of(self, score: np.ndarray, x: np.ndarray, search: np.ndarray, items: np.ndarray,
                    evidence: np.ndarray | None = None) -> np.ndarray:
        """z of scores with their `competition` x, side (`search`: bool, else an annotation's), collection's
        items and phrase evidence (`evidence` (..., 2): `evidence_terms` of each pair; None: none known, read as
        the terms of a sentence that names nothing), element by element: the one formula of the scale, for one
        query or for many pairs at once."""
        z = (self.slope * score + self.context * x
             + np.where(search, self.search_size, self.annotate_size) * np.log(items)
             + np.where(search, self.search_intercept, self.annotate_intercept))
        if evidence is not None and self.uses_evidence:
            e = np.asarray(evidence, dtype=np.float64)
            z = z + self.evidence[0] * e[..., 0] + self.evidence[1] * e[..., 1]
        return np.asarray(z)

    def __call__(self, score: float | np.ndarray, evidence: np.ndarray | None = None) -> np.ndarray:
        return probability(self.log_odds(score, evidence))

    def of(self, score: float, evidence: np.ndarray | None = None) -> float:
        return float(self(score, evidence))

    def to_state(self) -> dict[str, Any]:
        state = {"form": RELEVANCE_FORM, "slope": self.slope, "context": self.context, "beta": self.beta,
                 "search_intercept": self.search_intercept, "annotate_intercept": self.annotate_intercept,
                 "pad": self.pad, "search_size": self.search_size, "annotate_size": self.annotate_size,
                 "top": self.top}
        if self.uses_evidence:
            state.update(form=EVIDENCE_RELEVANCE_FORM, evidence=list(self.evidence))
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Relevance | None:
        """The scale stored; None for none, and for one of an earlier form (a curve of the score and the
        collection's size alone, or of the score and its competition alone: refit it with training.calibrate
        --relevance-only)."""
        if not state or state.get("form") not in (RELEVANCE_FORM, EVIDENCE_RELEVANCE_FORM):
            return None
        evidence = tuple(float(w) for w in state.get("evidence", (0.0, 0.0)))
        return cls(float(state["slope"]), float(state["context"]), float(state["beta"]),
                   float(state["search_intercept"]), float(state["annotate_intercept"]), float(state["pad"]),
                   float(state["search_size"]), float(state["annotate_size"]), int(state["top"]),
                   (evidence[0], evidence[1]))


@dataclass
class Calibration:
    """Reference fragments, embedded by the uncalibrated model (NumPy arrays in the service; torch tensors
    on the training device while a trainer fits them).

    ref_images: (R_i, F, h); ref_sentences: (R_s, T, h) with ref_sentence_mask (R_s, T);
    floor_image / floor_sentence: the smallest scale each side's items get.
    """

    ref_images: Array
    ref_sentences: Array
    ref_sentence_mask: Array
    floor_image: float = 0.0
    floor_sentence: float = 0.0
    relevance: Relevance | None = None  # fitted on the validation part; None in older checkpoints
    local_k: int = 0  # with local_power: how many of an item's best reference scores its local scale averages
    local_power: float = 0.0  # 0: the spread alone (checkpoints before it); p: the local scale's weight
    ref_image_scales: Array | None = None  # (blocks, R_i): the reference images' own spreads (with local_power)
    ref_sentence_scales: Array | None = None  # (blocks, R_s): the reference sentences' own spreads
    evidence: dict[str, Any] | None = None  # the phrase evidence weights (model/evidence.py), as stored
    pool: Array | None = None  # the model's S_kl weights over ranks (model/score.py; None: the mean), not stored:
    # the model's own (model.bundle), so that the references are scored with its S_kl
    _parts: dict[tuple[str, int | None, int | None], Array] = field(default_factory=dict, init=False,
                                                                     repr=False, compare=False)
    _codes: dict[tuple[int | None, int | None], QuantizedRows] = field(default_factory=dict, init=False,
                                                                       repr=False, compare=False)

    def reference(self, side: str, part: slice) -> Array:
        """The reference images' or sentences' fragments, or one block's slice of them (kept, contiguous: a
        strided slice would be copied by every S_kl that reads it, at every query)."""
        ref = self.ref_images if side == "images" else self.ref_sentences
        if part == slice(None):
            return ref
        key = (side, part.start, part.stop)
        if key not in self._parts:
            self._parts[key] = contiguous(ref[..., part])
        return self._parts[key]

    def reference_codes(self, part: slice = slice(None)) -> QuantizedRows | None:
        """The reference images' fragments (or one block's slice of them) as the codes a sentence's scores read
        (model/product.py `QuantizedRows`: a quarter of the bytes, multiplied in integers), kept; None where they
        are read in float32 (torch tensors in training, or `product.QUANTIZED` off)."""
        ref = self.reference("images", part)
        if not quantizes(ref):
            return None
        key = (part.start, part.stop)
        if key not in self._codes:
            self._codes[key] = QuantizedRows.of(ref)
        return self._codes[key]

    def image_scores(self, img: Array, part: slice = slice(None)) -> Array:
        """img: (K, F, h') uncalibrated image fragments -> (K, R_s) their S_kl against the reference sentences;
        with `part`, img holds that slice of h only (one block of a merged model), scored against the
        references' same slice."""
        ref = self.reference("sentences", part)
        xp = namespace(img, ref)
        ones = xp.ones(img.shape[:2], dtype=img.dtype, device=array_device(img))
        out = [skl(img[k : k + BLOCK], ones[k : k + BLOCK], ref, self.ref_sentence_mask, chunk=BLOCK, pool=self.pool)
               for k in range(0, img.shape[0], BLOCK)]
        return xp.concat(out, axis=0) if out else xp.zeros((0, ref.shape[0]), dtype=img.dtype)

    def sentence_scores(self, sent: Array, mask: Array, part: slice = slice(None)) -> Array:
        """sent: (L, T, h') uncalibrated sentence fragments, mask (L, T) -> (L, R_i) their S_kl against the
        reference images (`part`: as in `image_scores`)."""
        ref = self.reference("images", part)
        codes = self.reference_codes(part)
        xp = namespace(sent, ref)
        ones = xp.ones(ref.shape[:2], dtype=ref.dtype, device=array_device(ref))
        out = [xp.permute_dims(skl(ref, ones, sent[s : s + BLOCK], mask[s : s + BLOCK], pool=self.pool, rows=codes),
                               (1, 0))
               for s in range(0, sent.shape[0], BLOCK)]
        return xp.concat(out, axis=0) if out else xp.zeros((0, ref.shape[0]), dtype=sent.dtype)

    @staticmethod
    def _spread(scores: Array, floor: float) -> Array:
        """(n,) each item's scale from its (n, R) scores against the references: their spread, at least `floor`."""
        xp = namespace(scores)
        return xp.clip(xp.std(scores, axis=1, correction=0), min=floor)

    def image_scales(self, img: Array, part: slice = slice(None)) -> Array:
        """(K,) sigma_k: the spread of each image's S_kl against the reference sentences (`image_scores`)."""
        return self._spread(self.image_scores(img, part), self.floor_image)

    def sentence_scales(self, sent: Array, mask: Array, part: slice = slice(None)) -> Array:
        """(L,) tau_l: the spread of each sentence's S_kl against the reference images."""
        return self._spread(self.sentence_scores(sent, mask, part), self.floor_sentence)

    def localised(self, k: int, power: float, blocks: int = 1) -> Calibration:
        """This calibration with a local scale (`local_k`, `local_power`), and the references' own spreads it
        needs (computed here, stored with it)."""
        xp = namespace(self.ref_images)
        parts = block_slices(self.ref_images.shape[-1], blocks)
        images = xp.stack([self.image_scales(self.ref_images[..., p], p) for p in parts])
        sentences = xp.stack([self.sentence_scales(self.ref_sentences[..., p], self.ref_sentence_mask, p)
                              for p in parts])
        return replace(self, local_k=int(k), local_power=float(power), ref_image_scales=images,
                       ref_sentence_scales=sentences)

    def _calibrate(self, items: Array, scores: list[Array], floor: float, ref_scales: Array | None) -> Array:
        """items (n, ., h) by blocks, `scores` each block's (n, R) S_kl against the other side's references:
        each block divided by its spread, and with `local_power` p all blocks by the local scale^p, the mean
        of the item's `local_k` best calibrated reference scores (summed over the blocks, as the score is):
        an item close to many references, a hub, is scaled down more than its spread says."""
        xp = namespace(items)
        spreads = [self._spread(r, floor) for r in scores]
        parts = block_slices(items.shape[-1], len(scores))
        if self.local_power > 0 and self.local_k > 0 and items.shape[0]:
            if ref_scales is None or ref_scales.shape[0] != len(scores):
                raise ValueError("a local scale needs the references' own spreads (Calibration.localised)")
            calibrated = sum(r / (s[:, None] * ref_scales[b][None, :])
                             for b, (r, s) in enumerate(zip(scores, spreads, strict=True)))
            k = min(self.local_k, calibrated.shape[1])
            local = xp.mean(xp.sort(calibrated, axis=1)[:, -k:], axis=1)
            factor = xp.clip(local, min=1e-6) ** self.local_power
            spreads = [s * factor for s in spreads]
        return xp.concat([items[..., p] / s[:, None, None] for p, s in zip(parts, spreads, strict=True)], axis=-1)

    def calibrate_images(self, img: Array, blocks: int = 1) -> Array:
        """img (K, F, h) divided by sigma_k (and the local scale); for a merged model (`blocks` > 1) each
        block by its own sigma_k^b, so the S_kl of model/score.py becomes the sum of the members' calibrated
        S_kl. `BLOCK` images at a time (their scores against the references are all held at once)."""
        parts = block_slices(img.shape[-1], blocks)
        xp = namespace(img)
        out = [self._calibrate(chunk, [self.image_scores(chunk[..., p], p) for p in parts], self.floor_image,
                               self.ref_sentence_scales)
               for chunk in (img[k : k + BLOCK] for k in range(0, img.shape[0], BLOCK))]
        return xp.concat(out, axis=0) if out else img

    def calibrate_sentences(self, sent: Array, mask: Array, blocks: int = 1) -> Array:
        """sent (L, T, h) divided by tau_l (and the local scale), block by block for a merged model (as
        `calibrate_images`), `BLOCK` sentences at a time."""
        parts = block_slices(sent.shape[-1], blocks)
        xp = namespace(sent)
        out = [self._calibrate(sent[s : s + BLOCK],
                               [self.sentence_scores(sent[s : s + BLOCK, :, p], mask[s : s + BLOCK], p)
                                for p in parts], self.floor_sentence, self.ref_image_scales)
               for s in range(0, sent.shape[0], BLOCK)]
        return xp.concat(out, axis=0) if out else sent

    def numpy(self) -> Calibration:
        """The same references as float32 NumPy arrays (self when they are already)."""
        if isinstance(self.ref_images, np.ndarray):
            return self
        images, sentences, mask = (np.asarray(to_numpy(x), dtype=np.float32) for x in
                                   (self.ref_images, self.ref_sentences, self.ref_sentence_mask))
        own = [None if x is None else np.asarray(to_numpy(x), dtype=np.float32)
               for x in (self.ref_image_scales, self.ref_sentence_scales)]
        return Calibration(images, sentences, mask, self.floor_image, self.floor_sentence, self.relevance,
                           self.local_k, self.local_power, own[0], own[1], self.evidence)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The references as stored, at half precision (the scales are spreads: 3 significant digits are
        plenty): the reference sentences' real fragments only (`ref_sentence_rows`, in mask order: padding is
        two thirds of the padded array and never scored)."""
        mask = to_numpy(self.ref_sentence_mask) > 0
        own = {name: to_numpy(x).astype(np.float32) for name, x in (("ref_image_scales", self.ref_image_scales),
                                                                   ("ref_sentence_scales", self.ref_sentence_scales))
               if x is not None}
        return {"ref_images": to_numpy(self.ref_images).astype(np.float16),
                "ref_sentence_rows": to_numpy(self.ref_sentences)[mask].astype(np.float16),
                "ref_sentence_mask": mask, **own}

    def settings(self) -> dict[str, Any]:
        """What is stored beside the arrays: the floors, the local scale (when it is used), the relevance
        scale and the phrase evidence weights (when fitted)."""
        local = {"local_k": self.local_k, "local_power": self.local_power} if self.local_power > 0 else {}
        evidence = {"evidence": self.evidence} if self.evidence is not None else {}
        return {"floor_image": self.floor_image, "floor_sentence": self.floor_sentence, **local,
                "relevance": None if self.relevance is None else self.relevance.to_state(), **evidence}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], settings: dict[str, Any]) -> Calibration:
        """Back from `to_arrays` and `settings` (NumPy float32; older checkpoints stored the padded
        `ref_sentences`)."""
        mask = np.asarray(arrays["ref_sentence_mask"]).astype(bool)
        if "ref_sentence_rows" in arrays:
            rows = np.asarray(arrays["ref_sentence_rows"], dtype=np.float32)
            sentences = np.zeros((*mask.shape, rows.shape[-1]), np.float32)
            sentences[mask] = rows
        else:
            sentences = np.asarray(arrays["ref_sentences"], dtype=np.float32)
        own = [np.asarray(arrays[n], dtype=np.float32) if n in arrays else None
               for n in ("ref_image_scales", "ref_sentence_scales")]
        return cls(np.asarray(arrays["ref_images"], dtype=np.float32), sentences, mask.astype(np.float32),
                   float(settings["floor_image"]), float(settings["floor_sentence"]),
                   Relevance.from_state(settings.get("relevance")), int(settings.get("local_k", 0)),
                   float(settings.get("local_power", 0.0)), own[0], own[1], settings.get("evidence"))
