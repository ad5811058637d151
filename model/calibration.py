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

    def image_scales(self, img: Array, part: slice = slice(None)) -> Array:
        """img: (K, F, h') uncalibrated image fragments -> (K,) sigma_k; with `part`, img holds that slice of
        h only (one block of a merged model) and is scored against the references' same slice."""
        ref = self.reference("sentences", part)
        xp = namespace(img, ref)
        out = [xp.std(skl(img[k : k + BLOCK], xp.ones(img[k : k + BLOCK].shape[:2], dtype=img.dtype),
                          ref, self.ref_sentence_mask, chunk=BLOCK), axis=1, correction=0)
               for k in range(0, img.shape[0], BLOCK)]
        scales = xp.concat(out) if out else xp.zeros(0, dtype=img.dtype)
        return xp.clip(scales, min=self.floor_image)

    def sentence_scales(self, sent: Array, mask: Array, part: slice = slice(None)) -> Array:
        """sent: (L, T, h') uncalibrated sentence fragments, mask (L, T) -> (L,) tau_l (`part`: as in
        `image_scales`)."""
        ref = self.reference("images", part)
        xp = namespace(sent, ref)
        ones = xp.ones(ref.shape[:2], dtype=ref.dtype)
        out = [xp.std(skl(ref, ones, sent[s : s + BLOCK], mask[s : s + BLOCK]), axis=0, correction=0)
               for s in range(0, sent.shape[0], BLOCK)]
        scales = xp.concat(out) if out else xp.zeros(0, dtype=sent.dtype)
        return xp.clip(scales, min=self.floor_sentence)

    def calibrate_images(self, img: Array, blocks: int = 1) -> Array:
        """img (K, F, h) divided by sigma_k; for a merged model (`blocks` > 1) each block by its own sigma_k^b,
        so the S_kl of model/score.py becomes the sum of the members' calibrated S_kl."""
        xp = namespace(img)
        return xp.concat([img[..., p] / self.image_scales(img[..., p], p)[:, None, None]
                          for p in block_slices(img.shape[-1], blocks)], axis=-1)

    def calibrate_sentences(self, sent: Array, mask: Array, blocks: int = 1) -> Array:
        """sent (L, T, h) divided by tau_l, block by block for a merged model (as `calibrate_images`)."""
        xp = namespace(sent)
        return xp.concat([sent[..., p] / self.sentence_scales(sent[..., p], mask, p)[:, None, None]
                          for p in block_slices(sent.shape[-1], blocks)], axis=-1)

    def numpy(self) -> Calibration:
        """The same references as float32 NumPy arrays (self when they are already)."""
        if isinstance(self.ref_images, np.ndarray):
            return self
        images, sentences, mask = (np.asarray(to_numpy(x), dtype=np.float32) for x in
                                   (self.ref_images, self.ref_sentences, self.ref_sentence_mask))
        return Calibration(images, sentences, mask, self.floor_image, self.floor_sentence, self.relevance)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The references as stored, at half precision (the scales are spreads: 3 significant digits are
        plenty): the reference sentences' real fragments only (`ref_sentence_rows`, in mask order: padding is
        two thirds of the padded array and never scored)."""
        mask = to_numpy(self.ref_sentence_mask) > 0
        return {"ref_images": to_numpy(self.ref_images).astype(np.float16),
                "ref_sentence_rows": to_numpy(self.ref_sentences)[mask].astype(np.float16),
                "ref_sentence_mask": mask}

    def settings(self) -> dict[str, Any]:
        """What is stored beside the arrays: the floors and the relevance scale."""
        return {"floor_image": self.floor_image, "floor_sentence": self.floor_sentence,
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
                   Relevance.from_state(settings.get("relevance")))
