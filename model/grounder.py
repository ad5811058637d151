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
part of it, the mean of the likely boxes is nearer its own than any one of them. It changes no score: S_kl, the
rankings and the relevance are what they were; it says where the thing is. The weights are stored with the model
(``grd/*`` arrays, the ``grounder`` state); a model without them aligns as before.

The things and which triplets hold them are phrase evidence's (model/evidence.py ``named_things``); a triplet
draws the region of the thing it names (``named_by``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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


def geometry(boxes: np.ndarray) -> np.ndarray:
    """(F, len(GEOMETRY)) the fragments' boxes (F, 4) in the image's frame, row 0 the whole image (its box gives
    the image's size)."""
    b = np.asarray(boxes, dtype=np.float32)
    width, height = max(float(b[0, 2]), 1.0), max(float(b[0, 3]), 1.0)
    corners = b / np.asarray([width, height, width, height], dtype=np.float32)
    area = np.clip((corners[:, 2] - corners[:, 0]) * (corners[:, 3] - corners[:, 1]), 0.0, None)
    aspect = np.log((b[:, 2] - b[:, 0] + 1.0) / (b[:, 3] - b[:, 1] + 1.0))
    whole = np.zeros(len(b), np.float32)
    whole[0] = 1.0
    return np.concatenate([corners, area[:, None], np.sqrt(area)[:, None], aspect[:, None], whole[:, None]],
                          axis=1).astype(np.float32)


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


def fused_boxes(scores: np.ndarray, boxes: np.ndarray, temperature: float, overlap: float) -> np.ndarray:
    """(N, 4) `fused_box` of N things at once: their scores (N, F) of one image's fragments with boxes (F, 4)."""
    s = np.asarray(scores, dtype=np.float64)
    b = np.asarray(boxes, dtype=np.float64)
    rows = np.arange(len(s))
    best = np.argmax(s, axis=1)
    if temperature <= 0:
        return b[best].astype(np.float32)
    near = box_iou(b[best], b) >= overlap  # (N, F)
    near[rows, best] = True
    w = np.where(near, np.exp((s - s[rows, best][:, None]) / temperature), 0.0)
    return ((w @ b) / w.sum(axis=1, keepdims=True)).astype(np.float32)


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
    w2 (H,), b2 (); `state` says how it was trained."""

    w1: np.ndarray = field(repr=False)
    b1: np.ndarray = field(repr=False)
    w2: np.ndarray = field(repr=False)
    b2: float = 0.0
    state: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def h(self) -> int:
        return (int(self.w1.shape[1]) - len(GEOMETRY) - len(SCORES)) // 3

    @property
    def fusion(self) -> tuple[float, float]:
        """`fused_box`'s temperature and overlap: the state's, else `FUSION`."""
        own = self.state.get("fusion")
        return (float(own["temperature"]), float(own["overlap"])) if own else FUSION

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": np.asarray([self.b2], np.float32)}

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
        return cls(w1, np.asarray(arrays["b1"], np.float32), np.asarray(arrays["w2"], np.float32),
                   float(np.asarray(arrays["b2"]).reshape(-1)[0]), dict(state))

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
                                 (directions @ w_s.T + self.b1).astype(np.float32))


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
        shape = np.stack([geometry(b) for b in boxes])  # (K, F, len(GEOMETRY)): each image's own frame
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
        out = []
        for k in range(len(scores)):
            drawn = fused_boxes(scores[k], boxes[k], temperature, overlap)
            out.append({w: (int(np.argmax(scores[k, n])), [float(v) for v in drawn[n]])
                        for n, w in enumerate(self.things)})
        return out

    def of_triplets(self, regions: Mapping[str, T]) -> list[T | None]:
        """Each triplet's region (or place): its named thing's (`named_by`), None for one that names none."""
        out: list[T | None] = []
        for t in self.triplets:
            w = named_by(t, self.things)
            out.append(None if w is None else regions.get(w))
        return out
