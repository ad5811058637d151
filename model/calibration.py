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
A match is either the item the query was written for (one among the collection's N items: the odds that
it is this one fall as 1/(N - 1)) or another item that is described the same way (its share does not
depend on N). Both odds grow exponentially in S_kl, so

    odds(S, N) = exp(own_slope * S + own_intercept) / (N - 1) + exp(slope * S + intercept),

relevance = odds / (1 + odds): a monotone map of S_kl for a given collection, so it never changes a
ranking. The four numbers are fitted on the validation part of the training data (never dev) and stored
beside the reference sets (training/calibrate.py `fit_relevance`); a scale stored with the two numbers
of the described-alike part only reads as a plain logistic curve, and a checkpoint without any (made
before it existed, or an uncalibrated model) serves scores without a relevance. For a sentence collection N
counts the images its captions describe (`CAPTIONS_PER_IMAGE` captions an image, as in Flickr8K).

The scales are computed with the one S_kl (model/score.py), on NumPy arrays in the service and on torch
tensors in training alike (the array API: model/arrays.py). Fitting the references and the relevance, timing
them and the command line are training/calibrate.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from array_api_compat import device as array_device

from model.arrays import Array, contiguous, namespace, to_numpy
from model.score import block_slices, skl

BLOCK = 200  # items of the other side scored per step (bounds memory: BLOCK * F x R * T products)


DEFAULT_CUTOFF = 0.5  # relevance at which a match is as likely as not: below it, "no good match"
CAPTIONS_PER_IMAGE = 5  # a sentence collection of N captions describes about N / 5 images (Flickr8K's count)


def _exp(z: np.ndarray) -> np.ndarray:
    return np.exp(np.clip(z, -60.0, 60.0))


@dataclass(frozen=True)
class Relevance:
    """relevance(S) = odds / (1 + odds), odds = exp(slope * S + intercept) + exp(own_slope * S +
    own_intercept) / (items - 1): the probability that a person calls a result with the calibrated
    score S a match, in a collection of `items` items (`for_items`). own_slope > 0 and slope >= 0, so
    it ranks as S does. Without the own part (`own_slope` None: a scale fitted before it) it is the logistic
    curve of slope and intercept."""

    slope: float
    intercept: float
    own_slope: float | None = None
    own_intercept: float | None = None
    items: int = 2

    def for_items(self, items: int) -> Relevance:
        """This scale for a collection of `items` items (images; for sentences, the images they describe)."""
        return replace(self, items=max(2, int(items)))

    def log_odds(self, score: float | np.ndarray) -> np.ndarray:
        s = np.asarray(score, dtype=np.float64)
        z = self.slope * s + self.intercept
        if self.own_slope is None or self.own_intercept is None:
            return np.asarray(z)
        own = self.own_slope * s + self.own_intercept - np.log(self.items - 1)
        return np.asarray(np.logaddexp(z, own))

    def __call__(self, score: float | np.ndarray) -> np.ndarray:
        return np.asarray(1.0 / (1.0 + _exp(-self.log_odds(score))))

    def of(self, score: float) -> float:
        return float(self(score))

    def score_at(self, relevance: float) -> float:
        """The score whose relevance is `relevance` (0 < relevance < 1): the cut-off in S_kl."""
        target = float(np.log(relevance / (1.0 - relevance)))
        alone = [(target - self.intercept) / self.slope] if self.slope > 0 else []  # each part alone gets there
        if self.own_slope is None or self.own_intercept is None:
            return float(alone[0])
        hi = min([*alone, (target - self.own_intercept + np.log(self.items - 1)) / self.own_slope])
        lo = hi - 1.0
        while float(self.log_odds(lo)) > target:  # log-odds rise with S: bracket the cut-off, then bisect
            lo = hi - 2.0 * (hi - lo)
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if float(self.log_odds(mid)) < target:
                lo = mid
            else:
                hi = mid
        return float(0.5 * (lo + hi))

    def to_state(self) -> dict[str, float]:
        state = {"slope": self.slope, "intercept": self.intercept}
        if self.own_slope is not None and self.own_intercept is not None:
            state.update(own_slope=self.own_slope, own_intercept=self.own_intercept)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Relevance | None:
        if not state:
            return None
        own = state.get("own_slope"), state.get("own_intercept")
        return cls(float(state["slope"]), float(state["intercept"]),
                   None if own[0] is None else float(own[0]), None if own[1] is None else float(own[1]))


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
    pool: Array | None = None  # the model's S_kl weights over ranks (model/score.py; None: the mean), not stored:
    # the model's own (model.bundle), so that the references are scored with its S_kl
    _parts: dict[tuple[str, int | None, int | None], Array] = field(default_factory=dict, init=False,
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
        xp = namespace(sent, ref)
        ones = xp.ones(ref.shape[:2], dtype=ref.dtype, device=array_device(ref))
        out = [xp.permute_dims(skl(ref, ones, sent[s : s + BLOCK], mask[s : s + BLOCK], pool=self.pool), (1, 0))
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
                           self.local_k, self.local_power, own[0], own[1])

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
        """What is stored beside the arrays: the floors, the local scale (when it is used) and the relevance
        scale."""
        local = {"local_k": self.local_k, "local_power": self.local_power} if self.local_power > 0 else {}
        return {"floor_image": self.floor_image, "floor_sentence": self.floor_sentence, **local,
                "relevance": None if self.relevance is None else self.relevance.to_state()}

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
        return cls(np.asarray(arrays["ref_images"], dtype=np.float32), sentences, mask.astype(np.float32),
                   float(settings["floor_image"]), float(settings["floor_sentence"]),
                   Relevance.from_state(settings.get("relevance")), int(settings.get("local_k", 0)),
                   float(settings.get("local_power", 0.0)),
                   *(np.asarray(arrays[n], dtype=np.float32) if n in arrays else None
                     for n in ("ref_image_scales", "ref_sentence_scales")))
