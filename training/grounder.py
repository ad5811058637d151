"""Training the grounder (model/grounder.py) on the training images' Flickr30k Entities phrase boxes.

A sample is a boxed phrase of a training caption whose head noun (its last word) is a thing the caption's
triplets name (model/evidence.py ``named_things``), in its own image: the fragments whose box overlaps one of
the phrase's boxes at IoU >= ``IOU`` are its regions. The head scores every fragment of the image; the loss is
the softmax's negative log of the mass on the phrase's regions (a phrase whose boxes no fragment holds teaches
nothing and is left out of the training). Epochs are chosen on the validation part (the images --selection val
held out, training/calibrate.py ``split_of``), trained on the rest; dev is never read.

    python -m fragsearch.training.grounder --model model/released --out artifacts/models/released-grounder

The model is written in the runtime's form (a folder) with the head's weights; its accuracy on the validation
part (the chosen fragment holds the phrase at IoU >= 0.5, of every sample with a head-noun triplet) and the
whole image's on the same samples are logged and kept in the head's state. So is the box it draws
(model/grounder.py ``fused_box``): its temperature and overlap, the grid's best on the validation part.

The box refiner (model/grounder.py ``Refiner``) is trained after the head, on the same samples: every fragment
that overlaps a box of its phrase at IoU >= ``REFINE_IOU`` learns the deltas that move it onto that box (smooth L1,
R-CNN's box regression), with the epoch whose drawn boxes hold the most validation phrases; the fusion is then
chosen again with the moved boxes. `--refine-only` trains the refiner for the model's own head:

    python -m fragsearch.training.grounder --model model/released --refine-only --out artifacts/models/released-refined
`--fusion-only` chooses them for the model's own head, reading the validation part alone:

    python -m fragsearch.training.grounder --model model/released --fusion-only --out artifacts/models/released-fused

Its command line: fragsearch/commands/grounder.py (`python -m fragsearch.training.grounder` calls it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from fragsearch.model.boxes import box_iou
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData
from fragsearch.model.embed import embed_encoded
from fragsearch.model.entities import ImageEntities
from fragsearch.model.evidence import SCORES, score_features, thing_direction, thing_members, unit
from fragsearch.model.grounder import (
    FUSION_OVERLAPS,
    FUSION_TEMPERATURES,
    GEOMETRY,
    Grounder,
    Refiner,
    box_deltas,
    fused,
    fusion_weights,
    geometry,
)
from fragsearch.model.score import alignment_scores

logger = logging.getLogger("fragsearch.training.grounder")
IOU = 0.5  # a fragment holds a phrase at this IoU with one of its boxes (the grounding measure's)
HIDDEN = 256
EPOCHS = 12
BATCH = 256
LR = 1e-3
WEIGHT_DECAY = 1e-5
DROPOUT = 0.3
REFINE_IOU = 0.5  # a fragment teaches the refiner the phrase's box it overlaps this much
REFINE_HIDDEN = 256
REFINE_EPOCHS = 20
REFINE_BATCH = 512


@dataclass
class Samples:
    """Things in images: each sample's image (row of `images`), direction (N, h), score features (N, F, 3) and
    its fragments' best IoU with the truth (N, F); the images' unit fragments (K, F, h) and geometry (K, F, 8);
    the images' fragment boxes (K, F, 4) and each sample's true boxes (its phrase's, in the same frame)."""

    image: np.ndarray
    direction: np.ndarray
    scores: np.ndarray
    iou: np.ndarray
    images: np.ndarray
    geometry: np.ndarray
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 4), np.float32))
    truth: list[np.ndarray] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.image)

    def take(self, rows: np.ndarray) -> Samples:
        return Samples(self.image[rows], self.direction[rows], self.scores[rows], self.iou[rows], self.images,
                       self.geometry, self.boxes, [self.truth[int(r)] for r in rows] if self.truth else [])

    def whole_image(self) -> float:
        """How often the whole image holds the phrase (the baseline)."""
        return float((self.iou[:, 0] >= IOU).mean()) if len(self) else 0.0


def samples_of(bundle: Bundle, data: SplitData, entities: Mapping[str, ImageEntities],
               images: np.ndarray | None = None) -> Samples:
    """The boxed phrases of `data`'s captions in their own images (`images`: the images' fragments (K, F, h) as
    the index stores them; default: embedded here)."""
    if images is None:
        images = np.concatenate([bundle.embed_images(data.feats[k : k + 256])
                                 for k in range(0, len(data.names), 256)]) if len(data.names) else np.zeros((0, 1, 1))
    enc = bundle.text.encode_parsed(data.parsed, data.sentences)
    rows: dict[str, list[Any]] = {"image": [], "direction": [], "scores": [], "iou": [], "truth": []}
    for l, (sent, triplets) in enumerate(tqdm(embed_encoded(bundle, enc), desc="captions", unit="caption")):  # noqa: E741
        k = int(data.pair_image[l])
        ents = entities.get(data.names[k])
        if ents is None or not len(sent):
            continue
        caption = ents.match(data.sentences[l])
        if caption is None:
            continue
        things, members = thing_members(triplets)
        boxes = data.boxes[k]
        width, height = round(float(boxes[0, 2])), round(float(boxes[0, 3]))
        for phrase in ents.boxed(caption):
            if phrase.head not in things:
                continue
            held = sent[members[things.index(phrase.head)]]
            rows["image"].append(k)
            rows["direction"].append(thing_direction(held))
            rows["scores"].append(score_features(alignment_scores(images[k], held, bundle.blocks)))
            truth = ents.boxes_at(phrase.chain, width, height)
            rows["iou"].append(box_iou(boxes, truth).max(axis=1))
            rows["truth"].append(np.asarray(truth, np.float32).reshape(-1, 4))
    h = images.shape[-1]
    n_frag = images.shape[1]
    return Samples(np.asarray(rows["image"], np.int64),
                   np.asarray(rows["direction"], np.float32).reshape(-1, h),
                   np.asarray(rows["scores"], np.float32).reshape(-1, n_frag, len(SCORES)),
                   np.asarray(rows["iou"], np.float32).reshape(-1, n_frag),
                   np.stack([unit(x) for x in images]) if len(images) else images,
                   np.stack([geometry(b) for b in data.boxes]) if len(data.boxes) else np.zeros((0, n_frag, 8)),
                   np.asarray(data.boxes, np.float32).reshape(-1, n_frag, 4), rows["truth"])


def accuracy_of(grounder: Grounder, samples: Samples) -> float:
    """How often the head's choice holds the phrase (IoU >= `IOU`), computed as the runtime computes it."""
    if not len(samples):
        return 0.0
    picks = scores_of(grounder, samples).argmax(axis=1)
    return float((samples.iou[np.arange(len(samples)), picks] >= IOU).mean())


def moved_of(refiner: Refiner | None, samples: Samples, chunk: int = 16384) -> np.ndarray:
    """(N, F, 4) every sample's fragment boxes as the refiner moves them toward its thing (`Refiner.move`, the
    runtime's), the fragments' own without one."""
    k = samples.image
    boxes = samples.boxes[k]  # (N, F, 4)
    if refiner is None or not len(samples):
        return boxes.astype(np.float32)
    n_frag = boxes.shape[1]
    n, f = np.repeat(np.arange(len(samples)), n_frag), np.tile(np.arange(n_frag), len(samples))
    out = np.concatenate([
        refiner.move(samples.images[k[n[a : a + chunk]], f[a : a + chunk]], samples.direction[n[a : a + chunk]],
                     samples.geometry[k[n[a : a + chunk]], f[a : a + chunk]], boxes[n[a : a + chunk], f[a : a + chunk]],
                     boxes[n[a : a + chunk], 0, 2:4])
        for a in range(0, len(n), chunk)])
    return out.reshape(len(samples), n_frag, 4)


def fused_accuracy(scores: np.ndarray, samples: Samples, temperature: float, overlap: float,
                   moved: np.ndarray | None = None) -> float:
    """How often the box drawn from the head's `scores` (N, F) (`fused_box`; of the refiner's `moved` boxes
    (N, F, 4) where given, `moved_of`) holds the phrase (IoU >= `IOU`)."""
    return drawn_measures(scores, samples, temperature, overlap, moved)[0]


def drawn_measures(scores: np.ndarray, samples: Samples, temperature: float, overlap: float,
                   moved: np.ndarray | None = None) -> tuple[float, float]:
    """`fused_accuracy` and the mean IoU of the boxes drawn with the phrases' (the best of each's boxes)."""
    if not len(samples):
        return 0.0, 0.0
    ious = np.zeros(len(samples))
    for n in range(len(samples)):
        boxes = samples.boxes[samples.image[n]]
        w = fusion_weights(scores[n][None], boxes, temperature, overlap)
        box = fused(w, (boxes if moved is None else moved[n])[None])
        ious[n] = box_iou(box, samples.truth[n]).max(initial=0.0)
    return float((ious >= IOU).mean()), float(ious.mean())


def choose_fusion(grounder: Grounder, val: Samples) -> dict[str, float]:
    """`fused_box`'s temperature and overlap with the best accuracy on `val` over the grid (`FUSION_TEMPERATURES` x
    `FUSION_OVERLAPS`; ties to the grid's first), the boxes moved by the grounder's refiner where it has one; with
    the accuracy of the best fragment's own box beside it."""
    scores = scores_of(grounder, val)
    moved = moved_of(grounder.refiner, val)
    grid = [(t, c, fused_accuracy(scores, val, t, c, moved)) for t in FUSION_TEMPERATURES for c in FUSION_OVERLAPS]
    t, c, acc = max(grid, key=lambda g: g[2])  # max keeps the first of equals
    return {"temperature": t, "overlap": c, "val_accuracy": round(acc, 4),
            "val_unfused": round(fused_accuracy(scores, val, 0.0, 1.0), 4)}


def refine_pairs(samples: Samples, iou: float = REFINE_IOU) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The refiner's training pairs: samples (M,) and fragments (M,) that overlap a box of the sample's phrase at
    IoU >= `iou`, with the deltas (M, 4) that move the fragment onto the one it overlaps most (ties: the first)."""
    n, f = np.nonzero(samples.iou >= iou)
    boxes = samples.boxes[samples.image[n], f]
    targets = np.stack([samples.truth[i][int(np.argmax(box_iou(boxes[j][None], samples.truth[i])[0]))]
                        for j, i in enumerate(n)]) if len(n) else np.zeros((0, 4), np.float32)
    return n, f, box_deltas(boxes, targets)


def fit_refiner(grounder: Grounder, train: Samples, val: Samples, hidden: int = REFINE_HIDDEN,
                epochs: int = REFINE_EPOCHS, seed: int = 0, batch: int = REFINE_BATCH
                ) -> tuple[Grounder, dict[str, Any]]:
    """`grounder` with a box refiner trained on `train` (`refine_pairs`), at the epoch whose drawn boxes hold the
    most phrases of `val` (at the grounder's fusion; equals: the higher mean IoU), and the fusion chosen again
    with it (`choose_fusion`); `grounder` as it is where no pair teaches it or its boxes hold no more phrases of
    `val` (nor at a higher mean IoU) than the unmoved ones (the report says `kept: False`)."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    h = train.images.shape[-1]
    first, drop, last = (torch.nn.Linear(3 * h + len(GEOMETRY), hidden), torch.nn.Dropout(DROPOUT),
                         torch.nn.Linear(hidden, 4))
    opt = torch.optim.Adam([*first.parameters(), *last.parameters()], lr=LR, weight_decay=WEIGHT_DECAY)
    n, f, targets = refine_pairs(train)
    images, geo = torch.from_numpy(train.images), torch.from_numpy(train.geometry.astype(np.float32))
    directions, deltas = torch.from_numpy(train.direction), torch.from_numpy(targets)
    val_scores = scores_of(grounder, val)
    temperature, overlap = grounder.fusion

    def current() -> Refiner:
        return Refiner(first.weight.detach().numpy().copy(), first.bias.detach().numpy().copy(),
                       last.weight.detach().numpy().copy(), last.bias.detach().numpy().copy())

    best: tuple[tuple[float, float], int, Refiner] = ((-1.0, -1.0), -1, current())
    history = []
    for epoch in range(epochs):
        order = rng.permutation(len(n))
        total = 0.0
        for start in tqdm(range(0, len(order), batch), desc=f"refiner epoch {epoch + 1}", unit="batch", leave=False):
            rows = order[start : start + batch]
            k, ff = torch.from_numpy(train.image[n[rows]]), torch.from_numpy(f[rows])
            v, s = images[k, ff], directions[torch.from_numpy(n[rows])]
            out = last(drop(torch.relu(first(torch.cat([s * v, v, s, geo[k, ff]], dim=-1)))))
            loss = torch.nn.functional.smooth_l1_loss(out, deltas[torch.from_numpy(rows)])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(rows)
        r = current()
        measures = drawn_measures(val_scores, val, temperature, overlap, moved_of(r, val))
        history.append({"epoch": epoch + 1, "loss": round(total / max(len(n), 1), 4),
                        "val_accuracy": round(measures[0], 4), "val_mean_iou": round(measures[1], 4)})
        logger.info("refiner epoch %d: loss %.4f, validation accuracy %.4f, mean IoU %.4f", epoch + 1,
                    total / max(len(n), 1), *measures)
        if measures > best[0]:  # the accuracy, then the mean IoU; equals keep the earlier epoch
            best = (measures, epoch + 1, r)
    (acc, mean_iou), epoch, refiner = best
    unmoved = drawn_measures(val_scores, val, temperature, overlap)
    report: dict[str, Any] = {
        "epoch": epoch, "hidden": hidden, "iou": REFINE_IOU, "train_pairs": int(len(n)), "val_accuracy": round(acc, 4),
        "val_mean_iou": round(mean_iou, 4), "val_unmoved": round(unmoved[0], 4),
        "val_unmoved_mean_iou": round(unmoved[1], 4),
        "fusion_before": {"temperature": temperature, "overlap": overlap}, "history": history}
    if not len(n) or not (acc, mean_iou) > unmoved:  # nothing to learn from, or the boxes drawn no better: none
        logger.warning("the box refiner is not kept: %d training pairs; on the validation part %.4f (mean IoU %.4f) "
                       "moved, %.4f (%.4f) unmoved", len(n), acc, mean_iou, *unmoved)
        return grounder, {**report, "kept": False}
    refined = Grounder(grounder.w1, grounder.b1, grounder.w2, grounder.b2, grounder.state, refiner)
    report["fusion"] = choose_fusion(refined, val)
    logger.info("the box drawn, refined: %s", report["fusion"])
    state = {**grounder.state, "refiner": {k: v for k, v in report.items() if k != "fusion"},
             "fusion": report["fusion"]}
    return Grounder(grounder.w1, grounder.b1, grounder.w2, grounder.b2, state, refiner), report


def scores_of(grounder: Grounder, samples: Samples) -> np.ndarray:
    """(N, F) the head's scores, from its first layer's parts as model/grounder.py applies them."""
    h = grounder.h
    w1 = grounder.w1
    v = samples.images[samples.image]  # (N, F, h)
    s = samples.direction[:, None, :]
    hidden = ((s * v) @ w1[:, :h].T + v @ w1[:, h : 2 * h].T + s @ w1[:, 2 * h : 3 * h].T
              + samples.geometry[samples.image] @ w1[:, 3 * h : 3 * h + len(GEOMETRY)].T
              + samples.scores @ w1[:, 3 * h + len(GEOMETRY) :].T + grounder.b1)
    return np.asarray(np.maximum(hidden, 0.0) @ grounder.w2 + grounder.b2)


def fit_grounder(train: Samples, val: Samples, hidden: int = HIDDEN, epochs: int = EPOCHS, seed: int = 0,
                 batch: int = BATCH) -> tuple[Grounder, dict[str, Any]]:
    """The head trained on `train`, at the epoch with the best accuracy on `val`, with its measures."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    h = train.images.shape[-1]
    width = 3 * h + len(GEOMETRY) + len(SCORES)
    first, drop, last = torch.nn.Linear(width, hidden), torch.nn.Dropout(DROPOUT), torch.nn.Linear(hidden, 1)
    params = [*first.parameters(), *last.parameters()]
    opt = torch.optim.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY)
    keep = np.flatnonzero((train.iou >= IOU).any(axis=1))  # a phrase no fragment holds teaches nothing
    images, geo = torch.from_numpy(train.images), torch.from_numpy(train.geometry.astype(np.float32))

    def current() -> Grounder:
        return Grounder(first.weight.detach().numpy().copy(), first.bias.detach().numpy().copy(),
                        last.weight.detach().numpy()[0].copy(), float(last.bias.detach().numpy()[0]))

    best: tuple[float, int, Grounder] = (-1.0, -1, current())
    history = []
    for epoch in range(epochs):
        order = keep[rng.permutation(len(keep))]
        total = 0.0
        for start in tqdm(range(0, len(order), batch), desc=f"grounder epoch {epoch + 1}", unit="batch",
                          leave=False):
            rows = order[start : start + batch]
            k = torch.from_numpy(train.image[rows])
            v, s = images[k], torch.from_numpy(train.direction[rows])[:, None, :].expand(-1, images.shape[1], -1)
            x = torch.cat([s * v, v, s, geo[k], torch.from_numpy(train.scores[rows])], dim=-1)
            score = last(drop(torch.relu(first(x)))).squeeze(-1)
            pos = torch.from_numpy(train.iou[rows] >= IOU)
            loss = (torch.logsumexp(score, 1) - torch.logsumexp(score.masked_fill(~pos, -1e9), 1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(rows)
        g = current()
        acc = accuracy_of(g, val)
        history.append({"epoch": epoch + 1, "loss": round(total / max(len(keep), 1), 4), "val_accuracy": round(acc, 4)})
        logger.info("grounder epoch %d: loss %.4f, validation accuracy %.4f", epoch + 1, total / max(len(keep), 1), acc)
        if acc > best[0]:
            best = (acc, epoch + 1, g)
    acc, epoch, g = best
    report = {"epoch": epoch, "val_accuracy": round(acc, 4), "val_whole_image": round(val.whole_image(), 4),
              "val_upper_bound": round(float((val.iou >= IOU).any(axis=1).mean()) if len(val) else 0.0, 4),
              "val_samples": len(val), "train_samples": int(len(keep)), "history": history}
    state: dict[str, Any] = {"validation": report}
    if val.truth:
        state["fusion"] = report["fusion"] = choose_fusion(g, val)
        logger.info("the box drawn: %s", state["fusion"])
    return Grounder(g.w1, g.b1, g.w2, g.b2, state), report


if __name__ == "__main__":  # `python -m fragsearch.training.grounder`, as the docs write it: the command's alias
    from fragsearch.commands.grounder import main

    main()
