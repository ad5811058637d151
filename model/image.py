"""Images → fragments: the whole image plus the top object regions, each a 1280-d CNN feature.

Regions come from selective search (``model/proposals.py``), ranked by the bundled ImageNet
EfficientNet-Lite0 (``model/backbone.py``): a proposal's score is the largest softmax probability of
the ImageNet head on its pooled feature (an objectness proxy), or with ``ImageConfig.region_ranker`` the
region ranker's (``model/regions.py``: trained on people's boxes), followed by NMS. With
``ImageConfig.proposals`` "detector" / "detector_topup" they are the COCO detector's boxes
(``model/detector.py``), ranked by its scores, above every selective-search box that tops them up.
Boxes are ``[x0, y0, x1, y1]`` floats in the image's own pixels.

A picture whose longer side exceeds ``ImageConfig.decode_side`` is read at that side (``working_image``):
everything here sees at most 448 px of it (the backbone pass; crops and selective search less), so the
full size costs time and buys nothing. The boxes are still given in the picture's own pixels.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from fragsearch.model.backbone import Backbone, backbone_graph, backbone_head
from fragsearch.model.boxes import roi_align
from fragsearch.model.config import PROPOSAL_SOURCES, REGION_FEATURES, ImageConfig
from fragsearch.model.detector import N_CLASSES, Detector
from fragsearch.model.graphs import BACKBONE_NAME, find, preprocess, to_array
from fragsearch.model.imageio import Photo
from fragsearch.model.places import DEFAULT_PLACES, Places
from fragsearch.model.proposals import (
    N_GRID_BOXES,
    PROPOSAL_COLUMNS,
    detected_proposals,
    full_box,
    propose_boxes,
    select_regions,
    select_split_regions,
    sides_at_least,
    splits_regions,
    with_priors,
)
from fragsearch.model.regions import load_ranker

logger = logging.getLogger(__name__)

ROI_OUTPUT = 3  # roi_align pools a 3x3 grid of bins per box, then averages them
SCORE_SAMPLING = 1  # one bilinear sample per bin when scoring many proposals (cheap)
FEATURE_SAMPLING = 0  # adaptive sampling (about one sample per map cell) for the kept boxes


@dataclass
class ImageFragments:
    """One image as fragments: boxes (F, 4) float32 [x0, y0, x1, y1] in the image's pixels and
    features (F, D) float32 (D = 1280, the CNN's; with ``ImageConfig.detector_classes`` 1280 + 90, the
    detector's class scores after it: model/features.py ``feature_dim``); row 0 is the whole image."""

    boxes: np.ndarray
    features: np.ndarray
    width: int
    height: int


class RegionExtractor:
    """PIL image(s) → ImageFragments with ``cfg.n_fragments`` rows each.

    ``cfg.region_features``:

    * ``"roi_align"`` (Fast R-CNN style): one backbone pass on the image warped to
      ``cfg.backbone_size``²; each box is ``roi_align``-ed (3x3 bins, aligned) from the
      (1280, S/32, S/32) map and averaged; the whole-image row is the mean of the whole map.
      Proposals are scored from the same pass (one sample per bin; the kept boxes are pooled
      again with adaptive sampling).
    * ``"crop"`` (R-CNN style): regions are chosen with the same one-pass roi scoring, then each kept
      region is cropped from the image, warped to ``cfg.crop_size``² and run through the backbone on
      its own, global-average-pooled; the whole image row is the image at crop_size. The crops are
      scored at ``cfg.backbone_size`` (224 is enough to rank regions with sides >= 25 %). With
      ``cfg.mirror`` (a training view) every crop is flipped left to right before its pass: the
      features of the mirrored image's mirrored boxes.

    ``cfg.backbone_precision`` picks the float or the int8 backbone graph (``model/backbone.py``), run on
    ONNX Runtime on ``device``; the rest (box operations, the ImageNet head, pooling) runs in NumPy.
    """

    def __init__(self, cfg: ImageConfig, device: str = "cpu", runtime: str = "auto",
                 places: Places = DEFAULT_PLACES) -> None:
        if cfg.region_features not in REGION_FEATURES:
            raise ValueError(f"region_features must be one of {REGION_FEATURES}, got {cfg.region_features!r}")
        if cfg.n_regions > N_GRID_BOXES:
            raise ValueError(f"n_regions must be at most {N_GRID_BOXES} (the fallback grid size)")
        own = own_backbone(cfg)  # features by another net than the ranker
        if own and cfg.region_features != "crop" and not cfg.full_frame_only:
            raise ValueError("a fine-tuned or larger backbone (backbone_weights, backbone) needs region_features "
                             "'crop': its regions are ranked by the ImageNet Lite0, its features are the crops'")
        if cfg.mirror and cfg.region_features != "crop":
            raise ValueError("the mirrored view (mirror) needs region_features 'crop': its crops are flipped")
        if cfg.proposals not in PROPOSAL_SOURCES:
            raise ValueError(f"proposals must be one of {PROPOSAL_SOURCES}, got {cfg.proposals!r}")
        if cfg.detector_classes and (cfg.proposals == "selective_search" or cfg.full_frame_only):
            raise ValueError("detector_classes needs the detector's regions (proposals 'detector' or "
                             "'detector_topup'): its class scores are those of the boxes it proposed")
        if cfg.region_ranker and (cfg.proposals == "detector" or cfg.full_frame_only):
            raise ValueError("region_ranker ranks selective search's proposals (proposals 'selective_search' or "
                             "'detector_topup'): these settings have none to rank")
        if cfg.head_regions and not (cfg.region_ranker and cfg.proposals == "selective_search"):
            raise ValueError("head_regions splits the regions between the ImageNet head and a region ranker: it "
                             "needs region_ranker and selective search's proposals")
        self.cfg = cfg
        self.detector = (Detector() if cfg.proposals != "selective_search" and not cfg.full_frame_only
                         else None)
        self.places = places
        self.ranker = Backbone(device, cfg.backbone_precision, runtime, places)  # ImageNet Lite0: proposals, ranks
        self.backbone = (Backbone(device, cfg.backbone_precision, runtime, places, weights=cfg.backbone_weights,
                                  name=cfg.backbone)
                         if own else self.ranker)  # the fragments' features
        # read now: a missing head or ranker file is an error at start-up, not at the first image
        ranked = bool(cfg.region_ranker) and ranks_proposals(cfg)
        self.region_ranker = load_ranker(cfg.region_ranker, places.graphs) if ranked else None
        if ranks_proposals(cfg) and (self.region_ranker is None or splits_regions(cfg)):
            self.ranker.load_head()

    def extract(self, image: Image.Image | Photo) -> ImageFragments:
        """One picture → ImageFragments (boxes (F, 4), features (F, D))."""
        return self.extract_batch([image])[0]

    def extract_batch(self, images: Sequence[Image.Image | Photo]) -> list[ImageFragments]:
        """Pictures (decoded images, or Photos read at a reduced size) → one ImageFragments each,
        F = cfg.n_fragments rows, boxes in each picture's own pixels."""
        if not images:
            return []
        photos = [_photo(img) for img in images]
        rgb = [working_image(p.image, self.cfg) for p in photos]
        return self._given_back(photos, self._extract_working(rgb, [self._proposals(w) for w in rgb]))

    def extract_proposed(self, images: Sequence[Image.Image | Photo], proposals: Sequence[np.ndarray]
                         ) -> list[ImageFragments]:
        """Pictures with their proposals (``image_proposals`` of the decoded image: (P_k, 5) each, or (P_k, 4)
        boxes that the backbone ranks, in the decoded image's pixels) → one ImageFragments each, boxes in
        each picture's own pixels.

        The backbone half of ``extract_batch``: a pipeline that computes the proposals in other
        processes (a CPU stage) gets the same fragments. A proposal with a prior score (a detection)
        ranks by 1 + that score, above every proposal the backbone ranks (at most 1)."""
        if not images:
            return []
        photos = [_photo(img) for img in images]
        rgb = [working_image(p.image, self.cfg) for p in photos]
        proposals = [rescale_boxes(b, p.image.size, w.size) for b, p, w in zip(proposals, photos, rgb, strict=True)]
        return self._given_back(photos, self._extract_working(rgb, proposals))

    def ranked_inputs(self, image: Image.Image | Photo) -> tuple[np.ndarray, np.ndarray, int, int]:
        """What the proposals of one picture are ranked by: their boxes (P, 4) in its working image's pixels, the
        backbone's pooled features of each (P, 1280, one sample per bin, as ranked), and the working image's
        width and height. Selective search's proposals only (the region ranker's training data)."""
        work = working_image(_photo(image).image, self.cfg)
        w, h = work.size
        boxes = np.ascontiguousarray(propose_boxes(np.asarray(work), self.cfg), np.float32)
        fmap = self._maps([work], self.cfg.backbone_size)[0]
        return boxes, self._roi_pool(fmap, boxes, w, h, self.cfg.backbone_size, SCORE_SAMPLING), w, h

    def _proposals(self, work: Image.Image) -> np.ndarray:
        """The proposals of a working image (P, 5), in its pixels (``image_proposals`` without the resize)."""
        if self.cfg.full_frame_only:
            return np.zeros((0, 5), np.float32)
        return _found(work, self.cfg, self.detector)

    @staticmethod
    def _given_back(photos: Sequence[Photo], fragments: list[ImageFragments]) -> list[ImageFragments]:
        """Fragments of the working images with their boxes in each picture's own pixels."""
        return [f if (f.width, f.height) == (p.width, p.height) else _at_size(f, p.width, p.height)
                for f, p in zip(fragments, photos, strict=True)]

    def _extract_working(self, rgb: Sequence[Image.Image], proposals: Sequence[np.ndarray]) -> list[ImageFragments]:
        """``extract_proposed`` on the working images (RGB, at most decode_side), proposals in their pixels."""
        cfg = self.cfg
        if cfg.full_frame_only:
            return self._full_frame(rgb)
        priors = [p[:, 4] if p.shape[1] > 4 else np.full(len(p), np.nan, np.float32) for p in proposals]
        # the one backbone pass: roi features, or the ranking of proposals without a prior score
        need_map = cfg.region_features == "roi_align" or any(np.isnan(p).any() for p in priors)
        maps = self._maps(rgb, cfg.backbone_size) if need_map else None  # (B, 1280, h, w)
        side = cfg.backbone_size
        out: list[ImageFragments] = []
        chosen: list[np.ndarray] = []
        classes: list[np.ndarray] = []
        for k, img in enumerate(rgb):
            w, h = img.size
            props = np.ascontiguousarray(proposals[k][:, :4], dtype=np.float32)
            if splits_regions(cfg) and maps is not None:
                regions, rows = self._split_choice(maps[k], props, w, h)
            else:
                scores = (1.0 + priors[k]).astype(np.float32)
                unranked = np.isnan(scores)
                if unranked.any() and maps is not None:
                    pooled = self._roi_pool(maps[k], props[unranked], w, h, side, SCORE_SAMPLING)
                    scores[unranked] = self._rank(pooled, props[unranked], w, h)
                regions, rows = select_regions(props, scores, w, h, cfg)
            boxes = np.concatenate([full_box(w, h), regions])
            chosen.append(boxes)
            if cfg.detector_classes:
                classes.append(fragment_classes(proposals[k], rows))
            if cfg.region_features == "roi_align" and maps is not None:
                fmap = maps[k]
                feats = np.concatenate([fmap.mean(axis=(1, 2), dtype=np.float32)[None],
                                        self._roi_pool(fmap, regions, w, h, side)])
                out.append(ImageFragments(boxes, np.ascontiguousarray(feats, dtype=np.float32), w, h))
        if cfg.region_features == "crop":
            out = self._crop_features(rgb, chosen)
        if cfg.detector_classes:
            out = [ImageFragments(f.boxes, np.concatenate([f.features, c], axis=1), f.width, f.height)
                   for f, c in zip(out, classes, strict=True)]
        return out

    # -- internals -------------------------------------------------------------------------------

    def _maps(self, images: Sequence[Image.Image], side: int, backbone: Backbone | None = None,
              mirror: bool = False) -> np.ndarray:
        """Images warped to side² → their feature maps (B, 1280, side/32, side/32) (of the mirrored images with
        ``mirror``)."""
        x = np.stack([preprocess(img, side) for img in images])
        return (backbone or self.ranker).feature_map(x[..., ::-1] if mirror else x)

    def _roi_pool(
        self, fmap: np.ndarray, boxes: np.ndarray, w: int, h: int, side: int, sampling: int = FEATURE_SAMPLING
    ) -> np.ndarray:
        """fmap (1280, h', w') of the image warped to side², boxes (N, 4) in image pixels → (N, 1280)."""
        scaled = boxes * np.asarray([side / w, side / h, side / w, side / h], np.float32)
        rois = roi_align(fmap, scaled, output_size=ROI_OUTPUT, spatial_scale=fmap.shape[-1] / side,
                         sampling_ratio=sampling, aligned=True)  # (N, 1280, 3, 3)
        return rois.mean(axis=(2, 3), dtype=np.float32)

    def _rank(self, pooled: np.ndarray, boxes: np.ndarray, w: int, h: int) -> np.ndarray:
        """Pooled features (N, 1280) of boxes (N, 4) in a w x h image → (N,) float32 scores in [0, 1): the region
        ranker's order (``by_rank`` of its logits), or without one the ImageNet head's objectness (below 1 both,
        so a detection's 1 + score stays above every ranked box)."""
        if self.region_ranker is not None:
            return by_rank(self.region_ranker.score(pooled, boxes, w, h))
        return self._objectness(pooled)

    def _split_choice(self, fmap: np.ndarray, props: np.ndarray, w: int, h: int) -> tuple[np.ndarray, np.ndarray]:
        """The regions of one working image (``select_split_regions``) when the ImageNet head and the region
        ranker share them (``cfg.head_regions``): the head scores its pool (the larger boxes), the ranker all."""
        assert self.region_ranker is not None
        pooled = self._roi_pool(fmap, props, w, h, self.cfg.backbone_size, SCORE_SAMPLING)
        large = sides_at_least(props, w, h, self.cfg.head_min_box_frac)
        head = np.zeros(len(props), np.float32)
        if large.any():
            head[large] = self._objectness(pooled[large])
        ranked = by_rank(self.region_ranker.score(pooled, props, w, h))
        return select_split_regions(props, head, ranked, w, h, self.cfg)

    def _objectness(self, pooled: np.ndarray) -> np.ndarray:
        """(N, 1280) → (N,) float32 max ImageNet softmax probability."""
        return max_softmax(self.ranker.classify(pooled))

    def _full_frame(self, images: Sequence[Image.Image]) -> list[ImageFragments]:
        cfg = self.cfg
        side = cfg.backbone_size if cfg.region_features == "roi_align" else cfg.crop_size
        pooled = self._maps(images, side, self.backbone, mirror=cfg.mirror).mean(axis=(2, 3), dtype=np.float32)
        return [
            ImageFragments(full_box(*img.size), pooled[k : k + 1], img.size[0], img.size[1])
            for k, img in enumerate(images)
        ]

    def _crop_features(self, images: Sequence[Image.Image], boxes: Sequence[np.ndarray]) -> list[ImageFragments]:
        """Warp every box of every image to crop_size² and pool the backbone on each crop."""
        crops = np.concatenate([region_crops(img, bx, self.cfg.crop_size)
                                for img, bx in zip(images, boxes, strict=True)])
        if self.cfg.mirror:
            crops = crops[..., ::-1]
        pooled = self.backbone.pooled(crops)
        out, start = [], 0
        for img, bx in zip(images, boxes, strict=True):
            out.append(ImageFragments(bx, pooled[start : start + len(bx)], img.size[0], img.size[1]))
            start += len(bx)
        return out


def own_backbone(cfg: ImageConfig) -> bool:
    """Whether the fragments' features come from another network than the proposal ranker (the ImageNet
    Lite0): a fine-tuned or a larger backbone."""
    return bool(cfg.backbone_weights) or cfg.backbone != BACKBONE_NAME


def extractor_graphs(cfg: ImageConfig) -> list[tuple[str, str, str]]:
    """The backbone graphs a RegionExtractor of ``cfg`` runs, as (precision, backbone, weights): the ranker's (the
    ImageNet Lite0) and, for a fine-tuned or larger backbone, the features' own."""
    graphs = [(cfg.backbone_precision, BACKBONE_NAME, "")]
    if own_backbone(cfg):
        graphs.append((cfg.backbone_precision, cfg.backbone, cfg.backbone_weights))
    return graphs


def reads_head(cfg: ImageConfig) -> bool:
    """Whether a RegionExtractor of ``cfg`` ranks proposals with the ImageNet head's arrays."""
    return ranks_proposals(cfg) and (not cfg.region_ranker or splits_regions(cfg))


def extractor_files(cfg: ImageConfig, places: Places = DEFAULT_PLACES) -> list[Path]:
    """The backbone files a RegionExtractor of ``cfg`` reads (the ranker's graph, the features' own graph, the
    ranker's head or the region ranker's arrays), found (GraphMissing where one is not: the trainer's export step,
    training/graphs.py, makes them): what a pool checks once before its workers start."""
    files = [backbone_graph(precision, backbone, weights, places) for precision, backbone, weights
             in extractor_graphs(cfg)]
    if ranks_proposals(cfg) and cfg.region_ranker:
        ranker = find(cfg.region_ranker, places.graphs)
        if ranker is None:
            load_ranker(cfg.region_ranker, places.graphs)  # raises, saying where it was looked for
        else:
            files.append(ranker)
    if reads_head(cfg):
        files.append(backbone_head(places=places))
    return files


def ranks_proposals(cfg: ImageConfig) -> bool:
    """Whether the extractor of ``cfg`` ranks proposals by the ImageNet head (selective search's boxes, alone or
    topping up the detector's): whether it reads the head's arrays."""
    return not cfg.full_frame_only and cfg.proposals != "detector"


def by_rank(logits: np.ndarray) -> np.ndarray:
    """(N,) logits → (N,) float32 scores in [0, 1) in the same order, evenly spaced: the best (N - 1) / N, the last
    0. Equal logits keep the proposals' own order (the first above). A sigmoid would round large logits of
    float32 to one value and leave their order to chance."""
    order = np.argsort(-np.asarray(logits, np.float64), kind="stable")
    out = np.empty(len(order), np.float32)
    out[order] = (len(order) - 1 - np.arange(len(order))) / max(len(order), 1)
    return out


def max_softmax(logits: np.ndarray) -> np.ndarray:
    """(N, K) logits → (N,) float32 largest softmax probability of each row."""
    z = np.asarray(logits, np.float32)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).max(axis=1).astype(np.float32)


def image_proposals(image: Image.Image, cfg: ImageConfig, detector: Detector | None = None) -> np.ndarray:
    """The proposals of one image (P, 5) float32: boxes in its pixels and their prior scores (NaN: ranked
    by the backbone; model/proposals.py ``with_priors``): the CPU half of ``RegionExtractor.extract_batch``
    (none with ``cfg.full_frame_only``), found on its ``working_image``. Detector proposals use ``detector``
    (one is loaded when None)."""
    if cfg.full_frame_only:
        return np.zeros((0, 5), np.float32)
    work = working_image(image, cfg)
    return rescale_boxes(_found(work, cfg, detector or Detector()), work.size, image.size)


def _found(work: Image.Image, cfg: ImageConfig, detector: Detector | None) -> np.ndarray:
    """The proposals (P, 5) of a working image, in its pixels: selective search's (no detector needed), or
    the detector's."""
    rgb = np.asarray(work)
    if cfg.proposals == "selective_search":
        return with_priors(propose_boxes(rgb, cfg))
    return detected_proposals(rgb, cfg, detector or Detector())


def working_image(image: Image.Image, cfg: ImageConfig) -> Image.Image:
    """The image (RGB) as regions are found and read in it: its longer side reduced to ``cfg.decode_side``
    when larger (antialiased bilinear; sides rounded), as it is otherwise."""
    rgb = _rgb(image)
    side = cfg.decode_side
    w, h = rgb.size
    if not side or max(w, h) <= side:
        return rgb
    fit = side / max(w, h)
    return rgb.resize((max(1, round(w * fit)), max(1, round(h * fit))), Image.Resampling.BILINEAR)


def rescale_boxes(rows: np.ndarray, size: tuple[int, int], to: tuple[int, int]) -> np.ndarray:
    """Rows (P, >= 4) whose first four columns are boxes in an image of ``size`` (width, height) → the same
    rows with the boxes in an image of ``to``, clipped to it: the one place boxes move between a picture, its
    decoded copy and its working image. Scaling in float32 can land a side a fraction of a pixel past the
    edge (a 4,000 × 3,000 JPEG: 768 · (1,500 / 768) · (768 / 1,500) = 768.00006); clipping keeps every box
    inside its picture. The other columns (prior scores, class scores) are kept."""
    out = np.array(rows, dtype=np.float32)
    if not len(out):
        return out
    if tuple(size) != tuple(to):
        out[:, :4] *= np.asarray([to[0] / size[0], to[1] / size[1]] * 2, np.float32)
    limits = np.asarray([to[0], to[1], to[0], to[1]], np.float32)
    out[:, :4] = np.clip(out[:, :4], np.float32(0), limits)
    return out


def _at_size(frag: ImageFragments, width: int, height: int) -> ImageFragments:
    """Fragments of a working image with their boxes in the pixels of the picture itself (width x height)."""
    boxes = rescale_boxes(frag.boxes, (frag.width, frag.height), (width, height))
    return ImageFragments(boxes, frag.features, width, height)


def _photo(image: Image.Image | Photo) -> Photo:
    """A picture as a Photo: a decoded image is its own size."""
    return image if isinstance(image, Photo) else Photo(image, *image.size)


def fragment_classes(proposals: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """An image's proposals with class scores (P, 95) and the row each kept region came from (R,), -1 for a
    grid box → the detector's class scores of every fragment (1 + R, 90) float32: each region's own (zeros
    for a grid box or a box selective search proposed), the whole image's row the largest of each class
    over its regions."""
    if proposals.shape[1] != PROPOSAL_COLUMNS + N_CLASSES:
        raise ValueError(f"proposals without class scores ({proposals.shape[1]} columns): extract them with "
                         "detector_classes")
    table = np.nan_to_num(proposals[:, PROPOSAL_COLUMNS:].astype(np.float32))
    regions = np.zeros((len(rows), N_CLASSES), np.float32)
    found = rows >= 0
    regions[found] = table[rows[found]]
    whole = regions.max(axis=0, keepdims=True) if len(regions) else np.zeros((1, N_CLASSES), np.float32)
    return np.concatenate([whole, regions])


def _rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


def region_crops(image: Image.Image, boxes: np.ndarray, size: int) -> np.ndarray:
    """Each box (N, 4) [x0, y0, x1, y1] of an RGB image cropped and warped to size² → (N, 3, size, size)
    float32 in [-1, 1]: what the backbone sees of a region in "crop" mode."""
    crops = [to_array(np.asarray(image.resize((size, size), Image.Resampling.BILINEAR, box=_pil_box(b))))
             for b in boxes]
    return np.stack(crops) if crops else np.zeros((0, 3, size, size), np.float32)


def _pil_box(b: np.ndarray) -> tuple[float, float, float, float]:
    return (float(b[0]), float(b[1]), float(b[2]), float(b[3]))
