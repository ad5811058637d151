"""Grounding: for each thing a sentence names, the region of an image that holds it.

The alignment's own choice (each triplet's best-scoring region, model/score.py ``align``) is what S_kl sums,
and the fragment objective never told it where a thing is: checked against Flickr30k Entities' boxes it holds
the named thing less often than the whole image would (docs/results/grounding.md). The grounder is a small
head trained for that question alone, on the training images' phrase boxes (training/grounder.py): it reads,
for a thing and each of an image's fragments,

- the thing's direction: the mean of its triplets' unit vectors (``s``), and the fragment's unit vector
  (``v``), with their product ``s * v`` (which dimensions agree);
- the fragment's box in the image (corners, area, its square root, log aspect, whether it is the whole image);
- the triplets' alignment scores with the fragment (``alignment_scores``: their largest and mean, and how far the
  largest stands above the image's other fragments, in spreads),

through one hidden layer (ReLU) to a score; the thing's region is the fragment with the highest score (ties go to
the first), and the box drawn for it is that region's fused with the regions around it (`fused_box`: the boxes
overlapping it, weighed by the head's softmax): where the thing lies between two proposals, or one proposal holds
part of it, the mean of the likely boxes is nearer its own than any one of them. A grounder with a refiner
(``Refiner``: a second small head, trained on the same boxes) first moves each of those likely boxes toward the
thing it holds part of, reading the same fragment vector, thing direction and geometry (R-CNN's box regression:
the centre's shift in box widths and heights, the sides' log scale), and fuses the moved boxes. It changes no
score: S_kl, the rankings and the relevance are what they were; it says where the thing is. The weights are
stored with the model (``grd/*`` arrays, the refiner's ``grd/ref/*``, the ``grounder`` state); a model without
them aligns as before.

The things and which triplets hold them are phrase evidence's (model/evidence.py ``named_things``); a triplet
draws the region of the thing it names (``named_by``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import numpy as np

from fragsearch.model.boxes import box_iou
from fragsearch.model.evidence import (
    SCORES,
    THING_FIRST,
    score_features,
    second_is_thing,
    summary_of,
    thing_direction,
    thing_members,
    things_of,
    unit,
)
from fragsearch.model.fragments import WORD_REL
from fragsearch.model.score import alignment_scores
from fragsearch.model.text import Triplet

T = TypeVar("T")

GROUNDER_FORM = "grounder-1"  # the stored head's form (an earlier one is not read: retrain it)
GEOMETRY = ("x0", "y0", "x1", "y1", "area", "sqrt_area", "log_aspect", "whole")
REFINER_PREFIX = "ref/"  # the refiner's arrays among the grounder's


def geometry(boxes: np.ndarray) -> np.ndarray:
    """(..., F, len(GEOMETRY)) the fragments' boxes (..., F, 4) in their image's frame, each image's row 0 the whole
    image (its box gives the image's size)."""
    b = np.asarray(boxes, dtype=np.float32)
    width, height = np.maximum(b[..., :1, 2], 1.0), np.maximum(b[..., :1, 3], 1.0)  # (..., 1)
    corners = b / np.stack([width, height, width, height], axis=-1)
    area = np.clip((corners[..., 2] - corners[..., 0]) * (corners[..., 3] - corners[..., 1]), 0.0, None)
    aspect = np.log((b[..., 2] - b[..., 0] + 1.0) / (b[..., 3] - b[..., 1] + 1.0))
    whole = np.zeros(b.shape[:-1], np.float32)
    whole[..., 0] = 1.0
    return np.concatenate([corners, area[..., None], np.sqrt(area)[..., None], aspect[..., None], whole[..., None]],
                          axis=-1).astype(np.float32)


# `fused_box`'s temperature and overlap: a grounder's own (its state's "fusion", chosen on its validation part by
# training/grounder.py), else these, chosen the same way for the released model's grounder (the first of the grid's
# best; docs/results/grounding.md)
FUSION = (0.6, 0.2)
FUSION_TEMPERATURES = (0.5, 0.6, 0.75, 0.9, 1.0)  # the grid it is chosen from
FUSION_OVERLAPS = (0.1, 0.15, 0.2, 0.25, 0.3)


def fused_box(scores: np.ndarray, boxes: np.ndarray, temperature: float, overlap: float) -> np.ndarray:
    """(4,) the box drawn for a thing from the head's scores (F,) of an image's fragments with boxes (F, 4): the
    mean of the boxes that overlap the best-scoring one by at least `overlap` (IoU; the best one itself always),
    weighed by softmax(scores / temperature). Temperature 0: the best one's box alone."""
    return fused_boxes(np.asarray(scores)[None], boxes, temperature, overlap)[0]


def fusion_weights(scores: np.ndarray, boxes: np.ndarray, temperature: float, overlap: float) -> np.ndarray:
    """(N, F) `fused_box`'s weights of N things' scores (N, F) over one image's fragments with boxes (F, 4): the
    softmax of scores / temperature over the fragments overlapping each thing's best one, zero elsewhere (unnormed;
    temperature 0: the best one alone)."""
    s = np.asarray(scores, dtype=np.float64)
    b = np.asarray(boxes, dtype=np.float64)
    rows = np.arange(len(s))
    best = np.argmax(s, axis=1)
    if temperature <= 0:
        w = np.zeros(s.shape)
        w[rows, best] = 1.0
        return w
    near = box_iou(b[best], b) >= overlap  # (N, F)
    near[rows, best] = True
    return np.where(near, np.exp((s - s[rows, best][:, None]) / temperature), 0.0)


def fused_boxes(scores: np.ndarray, boxes: np.ndarray, temperature: float, overlap: float) -> np.ndarray:
    """(N, 4) `fused_box` of N things at once: their scores (N, F) of one image's fragments with boxes (F, 4)."""
    w = fusion_weights(scores, boxes, temperature, overlap)
    return fused(w, np.broadcast_to(np.asarray(boxes, np.float32)[None], (*w.shape, 4)))


def fused(weights: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """(N, 4) the mean of each thing's candidate boxes (N, F, 4) under its `fusion_weights` (N, F)."""
    w = np.asarray(weights, np.float64)
    c = np.where(w[:, :, None] > 0, np.asarray(candidates, np.float64), 0.0)
    return (np.einsum("nf,nfc->nc", w, c) / w.sum(axis=1, keepdims=True)).astype(np.float32)


# the refiner's deltas are in these units of (centre x, centre y, log width, log height) (R-CNN's), and a side's
# log scale is clipped to +-LOG_SCALE_CLIP
DELTA_UNITS = np.asarray([0.1, 0.1, 0.2, 0.2], np.float32)
LOG_SCALE_CLIP = 4.0


def box_deltas(boxes: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """(M, 4) the deltas (in `DELTA_UNITS`) that move boxes (M, 4) onto targets (M, 4): the centre's shift in
    the box's width and height, the sides' log scale (a side is at least a pixel)."""
    p = np.asarray(boxes, np.float64).reshape(-1, 4)
    t = np.asarray(targets, np.float64).reshape(-1, 4)
    pw, ph = np.maximum(p[:, 2] - p[:, 0], 1.0), np.maximum(p[:, 3] - p[:, 1], 1.0)
    tw, th = np.maximum(t[:, 2] - t[:, 0], 1.0), np.maximum(t[:, 3] - t[:, 1], 1.0)
    d = np.stack([((t[:, 0] + t[:, 2]) - (p[:, 0] + p[:, 2])) / (2 * pw),
                  ((t[:, 1] + t[:, 3]) - (p[:, 1] + p[:, 3])) / (2 * ph), np.log(tw / pw), np.log(th / ph)], 1)
    return (d / DELTA_UNITS).astype(np.float32)


def moved_boxes(boxes: np.ndarray, deltas: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """(M, 4) boxes (M, 4) moved by deltas (M, 4) (`box_deltas`'), clipped to their images' (width, height)
    (M, 2)."""
    p = np.asarray(boxes, np.float64).reshape(-1, 4)
    d = np.asarray(deltas, np.float64).reshape(-1, 4) * DELTA_UNITS
    pw, ph = np.maximum(p[:, 2] - p[:, 0], 1.0), np.maximum(p[:, 3] - p[:, 1], 1.0)
    cx, cy = (p[:, 0] + p[:, 2]) / 2 + d[:, 0] * pw, (p[:, 1] + p[:, 3]) / 2 + d[:, 1] * ph
    w = pw * np.exp(np.clip(d[:, 2], -LOG_SCALE_CLIP, LOG_SCALE_CLIP))
    h = ph * np.exp(np.clip(d[:, 3], -LOG_SCALE_CLIP, LOG_SCALE_CLIP))
    size = np.asarray(sizes, np.float64).reshape(-1, 2)
    return np.stack([np.clip(cx - w / 2, 0, size[:, 0]), np.clip(cy - h / 2, 0, size[:, 1]),
                     np.clip(cx + w / 2, 0, size[:, 0]), np.clip(cy + h / 2, 0, size[:, 1])], 1).astype(np.float32)


@dataclass(frozen=True)
class Refiner:
    """The box refiner's weights: w1 (R, 3h + len(GEOMETRY)) over [s * v, v, s, geometry], b1 (R,), w2 (4, R),
    b2 (4,): a thing's direction s and a fragment's unit vector v with its geometry → the deltas (`box_deltas`)
    that move the fragment's box onto the thing it holds part of."""

    w1: np.ndarray = field(repr=False)
    b1: np.ndarray = field(repr=False)
    w2: np.ndarray = field(repr=False)
    b2: np.ndarray = field(repr=False)

    @property
    def h(self) -> int:
        return (int(self.w1.shape[1]) - len(GEOMETRY)) // 3

    @cached_property
    def parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The first layer's weights of s * v, v, s and the geometry, each contiguous (split once)."""
        h = self.h
        return tuple(np.ascontiguousarray(self.w1[:, a:b]) for a, b in  # type: ignore[return-value]
                     ((0, h), (h, 2 * h), (2 * h, 3 * h), (3 * h, self.w1.shape[1])))

    def fold(self, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One thing's terms folded, for the fragments it is moved in (what `deltas` reads in place of s): the
        fragment vector's weights (R, h) and the thing's own term with the bias (R,)."""
        w_sv, w_v, w_s, _ = self.parts
        s = np.asarray(s, np.float32)
        return w_sv * s + w_v, (s @ w_s.T + self.b1).astype(np.float32)

    def deltas(self, v: np.ndarray, s: np.ndarray | tuple[np.ndarray, np.ndarray], shape: np.ndarray) -> np.ndarray:
        """(M, 4) the deltas of M fragments' unit vectors v (M, h) for things of directions s (M, h), or for one
        thing whose terms `fold` folded (a third of the product), the fragments' geometry (M, len(GEOMETRY))."""
        w_sv, w_v, w_s, w_g = self.parts
        v = np.asarray(v, np.float32)
        rest = np.asarray(shape, np.float32) @ w_g.T
        if isinstance(s, tuple):
            weights, own = s
            hidden = v @ weights.T + own + rest
        else:
            d = np.asarray(s, np.float32)
            hidden = (d * v) @ w_sv.T + v @ w_v.T + d @ w_s.T + self.b1 + rest
        return np.asarray(np.maximum(hidden, 0.0) @ self.w2.T + self.b2, np.float32)

    def move(self, v: np.ndarray, s: np.ndarray | tuple[np.ndarray, np.ndarray], shape: np.ndarray,
             boxes: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """(M, 4) M fragments' boxes (M, 4) moved by their `deltas`, clipped to their images' sizes (M, 2)."""
        return moved_boxes(boxes, self.deltas(v, s, shape), sizes)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": self.b2}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Refiner:
        w1, w2 = np.asarray(arrays["w1"], np.float32), np.asarray(arrays["w2"], np.float32)
        if w1.ndim != 2 or (w1.shape[1] - len(GEOMETRY)) % 3 or w2.shape != (4, w1.shape[0]):
            raise ValueError(f"the box refiner's layers have shapes {w1.shape} and {w2.shape}: not [s*v, v, s, "
                             "geometry] to 4 deltas")
        return cls(w1, np.asarray(arrays["b1"], np.float32), w2, np.asarray(arrays["b2"], np.float32))


def named_by(triplet: Triplet, things: Sequence[str]) -> str | None:
    """The thing a triplet names (its region is that thing's): the first word of a determiner or modifier
    relation, the second of a subject, object or preposition, a lone word's word; else the first of `things`
    it holds; None when it holds none."""
    held = things_of(triplet, things)
    if not held:
        return None
    if triplet.rel == WORD_REL or triplet.rel in THING_FIRST:
        role = triplet.w1
    elif second_is_thing(triplet.rel):
        role = triplet.w2
    else:
        role = held[0]
    return role if role in held else held[0]


@dataclass(frozen=True)
class Grounder:
    """The head's weights: w1 (H, 3h + len(GEOMETRY) + len(SCORES)) over [s * v, v, s, geometry, scores], b1 (H,),
    w2 (H,), b2 (); `state` says how it was trained; `refiner` moves the likely boxes before they are fused
    (None: they are fused as they are)."""

    w1: np.ndarray = field(repr=False)
    b1: np.ndarray = field(repr=False)
    w2: np.ndarray = field(repr=False)
    b2: float = 0.0
    state: Mapping[str, Any] = field(default_factory=dict, compare=False)
    refiner: Refiner | None = field(default=None, compare=False)

    @property
    def h(self) -> int:
        return (int(self.w1.shape[1]) - len(GEOMETRY) - len(SCORES)) // 3

    @property
    def fusion(self) -> tuple[float, float]:
        """`fused_box`'s temperature and overlap: the state's, else `FUSION`."""
        own = self.state.get("fusion")
        return (float(own["temperature"]), float(own["overlap"])) if own else FUSION

    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": np.asarray([self.b2], np.float32)}
        if self.refiner is not None:
            out.update({f"{REFINER_PREFIX}{k}": v for k, v in self.refiner.to_arrays().items()})
        return out

    def to_state(self) -> dict[str, Any]:
        return {**self.state, "form": GROUNDER_FORM, "hidden": int(self.w1.shape[0]), "geometry": list(GEOMETRY),
                "scores": list(SCORES)}

    def summary(self) -> dict[str, Any]:
        """The state without the per-epoch history (what a release's manifest records)."""
        return summary_of(self.to_state())

    @classmethod
    def from_parts(cls, state: Mapping[str, Any] | None, arrays: Mapping[str, np.ndarray]) -> Grounder | None:
        """The stored head (None: none stored, or of another form)."""
        if not state or state.get("form") != GROUNDER_FORM or "w1" not in arrays:
            return None
        w1 = np.asarray(arrays["w1"], np.float32)
        if w1.ndim != 2 or (w1.shape[1] - len(GEOMETRY) - len(SCORES)) % 3:
            raise ValueError(f"the grounder's first layer has shape {w1.shape}: not [s*v, v, s, geometry, scores]")
        refiner = ({k[len(REFINER_PREFIX) :]: v for k, v in arrays.items() if k.startswith(REFINER_PREFIX)}
                   if state.get("refiner") else {})
        return cls(w1, np.asarray(arrays["b1"], np.float32), np.asarray(arrays["w2"], np.float32),
                   float(np.asarray(arrays["b2"]).reshape(-1)[0]), dict(state),
                   Refiner.from_arrays(refiner) if refiner else None)

    def for_sentence(self, sent: np.ndarray, triplets: Sequence[Triplet], blocks: int) -> SentenceGrounding:
        """One sentence's things, their triplets and what the head reads of them once (sent (T, h))."""
        sent = np.asarray(sent, np.float32)
        things, members = thing_members(triplets)
        h = self.h
        w_sv, w_v, w_s = self.w1[:, :h], self.w1[:, h : 2 * h], self.w1[:, 2 * h : 3 * h]
        directions = (np.stack([thing_direction(sent[m]) for m in members]) if members
                      else np.zeros((0, h), np.float32))
        # v's weights per thing: its own term and its product with the thing's direction, in one matrix
        by_thing = w_sv[None, :, :] * directions[:, None, :] + w_v[None, :, :]  # (N, H, h)
        return SentenceGrounding(self, sent, list(triplets), things, members, blocks,
                                 np.ascontiguousarray(by_thing.reshape(-1, h), dtype=np.float32),
                                 (directions @ w_s.T + self.b1).astype(np.float32),
                                 [] if self.refiner is None else [self.refiner.fold(d) for d in directions])


@dataclass(frozen=True)
class SentenceGrounding:
    """A sentence read by the grounder: its things (phrase evidence's order), the triplet rows of each, and the
    head's terms that depend on the thing alone."""

    grounder: Grounder
    sent: np.ndarray
    triplets: list[Triplet]
    things: list[str]
    members: list[list[int]]
    blocks: int
    by_thing: np.ndarray = field(repr=False)  # (N H, h) the fragment vector's weights, each thing's (read
    # transposed by the product: a transposed copy of it cost more than the product)
    bias: np.ndarray = field(repr=False)  # (N, H) the thing's own term and the layer's bias
    folded: list[tuple[np.ndarray, np.ndarray]] = field(repr=False)  # each thing's terms of the refiner, folded

    def scores(self, img: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """(N, F) the head's score of each thing in each fragment of one image (img (F, h) with boxes (F, 4))."""
        return self.scores_of(np.asarray(img, np.float32)[None], np.asarray(boxes)[None])[0]

    def scores_of(self, imgs: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """(K, N, F) `scores` of K images of as many fragments (imgs (K, F, h) with boxes (K, F, 4)), in one
        product."""
        imgs = np.asarray(imgs, np.float32)
        k, n_frag, h = imgs.shape
        n_things = len(self.things)
        if not n_things:
            return np.zeros((k, 0, n_frag), np.float32)
        g = self.grounder
        hidden = g.w1.shape[0]
        w_g = g.w1[:, 3 * h : 3 * h + len(GEOMETRY)]
        w_a = g.w1[:, 3 * h + len(GEOMETRY) :]
        flat = imgs.reshape(k * n_frag, h)
        x = (unit(flat) @ self.by_thing.T).reshape(k, n_frag, n_things, hidden)  # (K, F, N, H)
        shape = geometry(boxes)  # (K, F, len(GEOMETRY)): each image's own frame
        x += (shape @ w_g.T)[:, :, None, :] + self.bias[None, None]
        grid = np.asarray(alignment_scores(flat, self.sent, self.blocks)).reshape(k, n_frag, -1)  # read once
        for n, rows in enumerate(self.members):
            x[:, :, n] += score_features(grid[:, :, rows]) @ w_a.T
        np.maximum(x, 0.0, out=x)
        return np.asarray((x @ g.w2).transpose(0, 2, 1) + g.b2, dtype=np.float32)

    def regions(self, img: np.ndarray, boxes: np.ndarray) -> dict[str, int]:
        """Each thing's region: the fragment the head scores highest (ties: the first)."""
        return self.regions_of(np.asarray(img, np.float32)[None], np.asarray(boxes)[None])[0]

    def regions_of(self, imgs: np.ndarray, boxes: np.ndarray) -> list[dict[str, int]]:
        """`regions` of K images of as many fragments (imgs (K, F, h), boxes (K, F, 4))."""
        best = np.argmax(self.scores_of(imgs, boxes), axis=-1)  # (K, N)
        return [{w: int(row[n]) for n, w in enumerate(self.things)} for row in best]

    def places_of(self, imgs: np.ndarray, boxes: np.ndarray) -> list[dict[str, tuple[int, list[float]]]]:
        """For K images of as many fragments (imgs (K, F, h), boxes (K, F, 4)), each thing's region and the box
        drawn for it (`fused_box`, with the grounder's `fusion`)."""
        scores = self.scores_of(imgs, boxes)  # (K, N, F)
        temperature, overlap = self.grounder.fusion
        boxes = np.asarray(boxes, np.float32)
        weights = [fusion_weights(scores[k], boxes[k], temperature, overlap) for k in range(len(scores))]
        moved = self.moved_of(imgs, boxes, np.asarray([w > 0 for w in weights], bool))
        out = []
        for k in range(len(scores)):
            drawn = fused(weights[k], moved[k])
            out.append({w: (int(np.argmax(scores[k, n])), [float(v) for v in drawn[n]])
                        for n, w in enumerate(self.things)})
        return out

    def moved_of(self, imgs: np.ndarray, boxes: np.ndarray, near: np.ndarray) -> np.ndarray:
        """(K, N, F, 4) each thing's candidate boxes in K images (imgs (K, F, h) with boxes (K, F, 4)): the
        grounder's refiner moves those of `near` (K, N, F) toward the thing (`Refiner.move`, one product per thing
        for the K images); the others, and all without a refiner, are the fragments' own."""
        b = np.asarray(boxes, np.float32)
        out = np.repeat(b[:, None], len(self.things), axis=1)
        refiner = self.grounder.refiner
        if refiner is None or not near.any():
            return out
        imgs = np.asarray(imgs, np.float32)
        v = unit(imgs.reshape(-1, imgs.shape[-1])).reshape(imgs.shape)
        shape = geometry(b)
        for n in range(len(self.things)):
            k, f = np.nonzero(near[:, n])
            if len(k):
                out[k, n, f] = refiner.move(v[k, f], self.folded[n], shape[k, f], b[k, f], b[k, 0, 2:4])
        return out

    def of_triplets(self, regions: Mapping[str, T]) -> list[T | None]:
        """Each triplet's region (or place): its named thing's (`named_by`), None for one that names none."""
        out: list[T | None] = []
        for t in self.triplets:
            w = named_by(t, self.things)
            out.append(None if w is None else regions.get(w))
        return out
