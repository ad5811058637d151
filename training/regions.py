"""Train the region ranker (model/regions.py): which selective-search proposals to keep as an image's regions, learnt
from the boxes people drew for the phrases of its captions (Flickr30k Entities).

    python -m fragsearch.training.regions --model model/released --out artifacts/models/released-regions

For a sample of the images the model was trained on and for its whole validation part: every proposal of the
image (selective search with the model's settings, boxes with a side of at least ``--min-box-frac`` of the
image's), its pooled features as the extractor ranks them and the Entities boxes of its captions' phrases. A
proposal is a positive when it overlaps a box of some phrase at IoU >= 0.5. One hidden layer, binary
cross-entropy; the epoch kept is the one whose regions (the ranker's order, NMS, 19 kept beside the whole
image, as the extractor chooses them) hold a box for the most phrases of the validation part (each phrase of
each caption counted once, as bench.grounding counts them). Dev is never read.

Written: the ranker's file (``region-ranker-<digest>.npz``) into the graph folder, where the extractor finds it,
and into ``--out`` with the model, its image settings naming the ranker and the smaller boxes
(``region_ranker``, ``min_box_frac``), and ``regions.json``: the validation part's share of phrases the regions
hold, with the model's own settings and with the ranker, per entity type. The model's encoders are not
retrained: its fragments are then read from the ranker's regions.

Its command line: fragsearch/commands/regions.py (`python -m fragsearch.training.regions` calls it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fragsearch.model.boxes import box_iou
from fragsearch.model.config import ImageConfig
from fragsearch.model.entities import ImageEntities
from fragsearch.model.image import RegionExtractor
from fragsearch.model.proposals import full_box, select_regions
from fragsearch.model.regions import RegionRanker, geometry

logger = logging.getLogger("fragsearch.training.regions")
IOU = 0.5
HIDDEN = 64
EPOCHS = 10
IMAGES = 2500  # images of the part trained on read for the ranker's training
MIN_BOX_FRAC = 0.06
BATCH = 512


@dataclass
class Picture:
    """One image's proposals (P, 4) in its working pixels, their pooled features (P, D) float16, the image's
    size, and its phrases' boxes: per Entities chain (K, 4) with the chain's phrase count and types."""

    boxes: np.ndarray
    pooled: np.ndarray
    width: int
    height: int
    chains: list[tuple[np.ndarray, int, tuple[str, ...]]] = field(default_factory=list)

    def labels(self) -> np.ndarray:
        """(P,) float32: 1 where a proposal overlaps a box of some phrase at IoU >= 0.5."""
        if not self.chains or not len(self.boxes):
            return np.zeros(len(self.boxes), np.float32)
        best = np.stack([box_iou(self.boxes, truth).max(axis=1) for truth, _, _ in self.chains], axis=1)
        out = np.asarray((best >= IOU).any(axis=1), np.float32)
        return out


def picture_of(extractor: RegionExtractor, path: Path, entities: ImageEntities) -> Picture:
    """An image's proposals, their pooled features and its phrases' boxes in its working pixels."""
    from fragsearch.model.features import PhotoReader

    boxes, pooled, w, h = extractor.ranked_inputs(PhotoReader.of(extractor.cfg).read(path))
    counts: dict[str, int] = defaultdict(int)
    types: dict[str, tuple[str, ...]] = {}
    for caption in entities.captions:
        for phrase in entities.boxed(caption):
            counts[phrase.chain] += 1
            types[phrase.chain] = phrase.types
    chains = [(entities.boxes_at(c, w, h), n, types[c]) for c, n in sorted(counts.items())]
    return Picture(boxes, pooled.astype(np.float16), w, h, [c for c in chains if len(c[0])])


def pictures_of(cfg: ImageConfig, paths: Sequence[Path], entities: Mapping[str, ImageEntities], what: str
                ) -> list[Picture]:
    """The pictures of the images among `paths` that have Entities annotations."""
    extractor = RegionExtractor(dataclasses.replace(cfg, region_ranker=""))
    return [picture_of(extractor, p, entities[p.name]) for p in tqdm(paths, desc=what, unit="image")
            if p.name in entities]


def regions_of(picture: Picture, scores: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """The image's fragments (1 + n_regions, 4) when its proposals are kept in the order of `scores`."""
    regions, _ = select_regions(picture.boxes, scores, picture.width, picture.height, cfg)
    return np.concatenate([full_box(picture.width, picture.height), regions])


def held(pictures: Iterable[Picture], scores: Iterable[np.ndarray], cfg: ImageConfig) -> dict[str, float]:
    """The share of phrases (each phrase of each caption) whose box a fragment overlaps at IoU >= 0.5, overall
    ("all") and per entity type, when each picture's proposals are kept in the order of its scores."""
    hit: dict[str, float] = defaultdict(float)
    total: dict[str, float] = defaultdict(float)
    for picture, s in zip(pictures, scores, strict=True):
        fragments = regions_of(picture, s, cfg)
        for truth, n, types in picture.chains:
            got = float(box_iou(fragments, truth).max() >= IOU)
            for kind in ("all", *types):
                hit[kind] += n * got
                total[kind] += n
    return {k: round(100 * hit[k] / total[k], 1) for k in sorted(total, key=lambda k: (k != "all", k))}


def inputs_of(picture: Picture) -> np.ndarray:
    """The ranker's inputs of a picture's proposals before standardising (P, D + GEOMETRY)."""
    return np.concatenate([picture.pooled.astype(np.float32), geometry(picture.boxes, picture.width,
                                                                        picture.height)], axis=1)


def fit_ranker(train: Sequence[Picture], val: Sequence[Picture], cfg: ImageConfig, hidden: int = HIDDEN,
               epochs: int = EPOCHS, seed: int = 0) -> tuple[RegionRanker, dict[str, Any]]:
    """The ranker of the epoch whose regions hold the most validation phrases, and the report of every epoch."""
    import torch

    torch.manual_seed(seed)
    x = np.concatenate([inputs_of(p) for p in train])
    y = np.concatenate([p.labels() for p in train])
    if not len(x) or y.min() == y.max():
        raise ValueError("the region ranker needs proposals that hold a phrase's box and proposals that do not")
    mean = x.mean(axis=0).astype(np.float32)
    scale = (x.std(axis=0) + 1e-4).astype(np.float32)
    xt = torch.from_numpy((x - mean) / scale)
    yt = torch.from_numpy(y)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(hidden, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    history: list[dict[str, Any]] = []
    best: tuple[float, int, RegionRanker] | None = None
    for epoch in range(epochs):
        net.train()
        total = 0.0
        order = torch.randperm(len(xt), generator=gen)
        for start in range(0, len(order), BATCH):
            b = order[start : start + BATCH]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(net(xt[b])[:, 0], yt[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
        net.eval()
        first, last = net[0], net[3]
        assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
        ranker = RegionRanker(mean, scale, first.weight.detach().numpy().T.copy(),
                              first.bias.detach().numpy().copy(), last.weight.detach().numpy()[0].copy(),
                              float(last.bias.detach()[0]))
        shares = held(val, (ranker.score(p.pooled, p.boxes, p.width, p.height) for p in val), cfg)
        history.append({"epoch": epoch + 1, "loss": round(total / len(xt), 4), "val_held": shares["all"]})
        logger.info("epoch %d: loss %.4f, validation phrases held %.1f %%", epoch + 1, total / len(xt), shares["all"])
        if best is None or shares["all"] > best[0]:
            best = (shares["all"], epoch + 1, ranker)
    assert best is not None
    return best[2], {"epoch": best[1], "history": history, "train_images": len(train),
                     "train_proposals": int(len(x)), "positive_share": round(float(y.mean()), 4)}


if __name__ == "__main__":  # `python -m fragsearch.training.regions`, as the docs write it: the command's alias
    from fragsearch.commands.regions import main

    main()
