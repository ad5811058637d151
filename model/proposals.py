"""Region proposals: selective search boxes (class-agnostic, weight-free), the COCO detector's boxes
(model/detector.py), the fixed fallback grid, and the choice of the kept regions from scored proposals
(near-full-frame boxes dropped, NMS).

Boxes are ``[x0, y0, x1, y1]`` floats in the image's own pixels.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import cv2
import numpy as np

from fragsearch.model.boxes import box_iou, nms
from fragsearch.model.config import PROPOSAL_MODES, ImageConfig
from fragsearch.model.detector import CANDIDATE_FLOOR, N_CLASSES, Detector

logger = logging.getLogger(__name__)

FULL_FRAME_DUP_IOU = 0.9  # proposals this close to the whole image duplicate row 0 and are dropped

# Fixed fallback boxes as fractions of the image (x0, y0, x1, y1): centre, halves, quadrants,
# a larger centre and the 3x3 thirds — 19 boxes, enough to fill every region slot.
_GRID_FRACTIONS: tuple[tuple[float, float, float, float], ...] = (
    (0.25, 0.25, 0.75, 0.75),
    (0.0, 0.0, 0.5, 1.0),
    (0.5, 0.0, 1.0, 1.0),
    (0.0, 0.0, 1.0, 0.5),
    (0.0, 0.5, 1.0, 1.0),
    (0.0, 0.0, 0.5, 0.5),
    (0.5, 0.0, 1.0, 0.5),
    (0.0, 0.5, 0.5, 1.0),
    (0.5, 0.5, 1.0, 1.0),
    (1 / 6, 1 / 6, 5 / 6, 5 / 6),
    *(
        (c / 3, r / 3, (c + 1) / 3, (r + 1) / 3)
        for r in range(3)
        for c in range(3)
    ),
)

N_GRID_BOXES = len(_GRID_FRACTIONS)
PROPOSAL_COLUMNS = 5  # x0, y0, x1, y1 and the prior score (``with_priors``)


def proposal_columns(cfg: ImageConfig) -> int:
    """Columns of an image's proposals under ``cfg``: the box and its prior score, and with
    ``cfg.detector_classes`` the detector's 90 class scores after them."""
    return PROPOSAL_COLUMNS + (N_CLASSES if cfg.detector_classes else 0)

_libc: ctypes.CDLL | None = None
_libc_checked = False


def _seed_proposal_order(seed: int = 0) -> None:
    """OpenCV's selective search orders its boxes with the C library's rand(): seed it so that the
    same image always yields the same ranked list (no effect where libc cannot be reached)."""
    global _libc, _libc_checked
    if not _libc_checked:
        _libc_checked = True
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else None
        except OSError:
            _libc = None
    if _libc is not None:
        _libc.srand(ctypes.c_uint(seed))


def _selective_search(bgr: np.ndarray, mode: str) -> cv2.ximgproc.segmentation.SelectiveSearchSegmentation:
    """A configured OpenCV selective search on an (H, W, 3) uint8 BGR image.

    ``single``: HSV, k = 200, one combined strategy (1 grouping). ``fast``: HSV + Lab, k = 150, 300,
    450, two strategies (12 groupings). ``quality``: OpenCV's quality mode (80 groupings).
    ``balanced``: ``fast`` without its coarsest k and its colour-blind strategy — HSV + Lab,
    k = 150, 300, colour + fill + size + texture (4 groupings, about 0.55x the time of ``fast``).
    """
    seg = cv2.ximgproc.segmentation
    ss = seg.createSelectiveSearchSegmentation()
    if mode == "balanced":
        for space in (cv2.COLOR_BGR2HSV, cv2.COLOR_BGR2Lab):
            ss.addImage(cv2.cvtColor(bgr, space))
        for k in (150.0, 300.0):
            ss.addGraphSegmentation(seg.createGraphSegmentation(0.8, k))
        ss.addStrategy(
            seg.createSelectiveSearchSegmentationStrategyMultiple(
                seg.createSelectiveSearchSegmentationStrategyColor(),
                seg.createSelectiveSearchSegmentationStrategyFill(),
                seg.createSelectiveSearchSegmentationStrategySize(),
                seg.createSelectiveSearchSegmentationStrategyTexture(),
            )
        )
        return ss
    ss.setBaseImage(bgr)
    if mode == "fast":
        ss.switchToSelectiveSearchFast()
    elif mode == "quality":
        ss.switchToSelectiveSearchQuality()
    else:
        ss.switchToSingleStrategy()
    return ss


def propose_boxes(image: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """Selective search boxes for an (H, W, 3) uint8 RGB image → (P, 4) float32 [x0, y0, x1, y1]
    in the image's pixels, in selective search's rank order.

    Runs on the image resized so its longer side is ``cfg.proposal_resize``; drops boxes with a side
    under ``cfg.min_box_frac`` of the image side, duplicates, and keeps at most ``cfg.max_proposals``.
    """
    if cfg.proposal_mode not in PROPOSAL_MODES:
        raise ValueError(f"proposal_mode must be one of {PROPOSAL_MODES}, got {cfg.proposal_mode!r}")
    h, w = image.shape[:2]
    scale = cfg.proposal_resize / max(h, w)
    rw, rh = max(1, round(w * scale)), max(1, round(h * scale))
    small = image
    if (rw, rh) != (w, h):
        interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR
        small = cv2.resize(image, (rw, rh), interpolation=interp)
    bgr = np.ascontiguousarray(small[:, :, ::-1])
    try:
        ss = _selective_search(bgr, cfg.proposal_mode)
        _seed_proposal_order()
        rects = np.asarray(ss.process(), dtype=np.float64).reshape(-1, 4)
    except cv2.error as e:
        logger.warning("selective search failed on a %dx%d image: %s", w, h, e)
        return np.zeros((0, 4), np.float32)
    sx, sy = w / rw, h / rh
    boxes = np.stack(
        [rects[:, 0] * sx, rects[:, 1] * sy, (rects[:, 0] + rects[:, 2]) * sx, (rects[:, 1] + rects[:, 3]) * sy],
        axis=1,
    )
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
    rows = _pool(boxes, w, h, cfg.min_box_frac, cfg.max_proposals)
    if splits_regions(cfg):  # and the head's own pool (first of those with its larger sides), in the same order
        rows = np.union1d(rows, _pool(boxes, w, h, cfg.head_min_box_frac, cfg.max_proposals))
    return boxes[rows].astype(np.float32)


def _pool(boxes: np.ndarray, w: int, h: int, frac: float, cap: int) -> np.ndarray:
    """The rows (sorted) of the first ``cap`` distinct boxes (rounded to pixels) whose sides are at least
    ``frac`` of the image's."""
    rows = np.flatnonzero(sides_at_least(boxes, w, h, frac))
    _, first = np.unique(np.round(boxes[rows]).astype(np.int64), axis=0, return_index=True)
    return rows[np.sort(first)][:cap]


def sides_at_least(boxes: np.ndarray, w: int, h: int, frac: float) -> np.ndarray:
    """(P,) bool: which boxes (P, 4) of a w x h image have both sides at least ``frac`` of the image's."""
    b = np.asarray(boxes).reshape(-1, 4)
    return ((b[:, 2] - b[:, 0]) >= frac * w) & ((b[:, 3] - b[:, 1]) >= frac * h)


def splits_regions(cfg: ImageConfig) -> bool:
    """Whether the regions of ``cfg`` split between the ImageNet head and a region ranker (``head_regions``)."""
    return bool(cfg.region_ranker) and cfg.head_regions > 0


def with_priors(boxes: np.ndarray, priors: np.ndarray | None = None, classes: np.ndarray | None = None
                ) -> np.ndarray:
    """Boxes (P, 4) → proposals (P, 5): the boxes and each one's prior score in column 4 — a detection's
    score (0..1), or NaN for a box that the backbone still has to rank (selective search); with ``classes``
    (P, 90), the detector's class scores of each box, (P, 95)."""
    col = np.full((len(boxes), 1), np.nan, np.float32) if priors is None else priors.reshape(-1, 1)
    parts = [boxes.reshape(-1, 4).astype(np.float32), col.astype(np.float32)]
    if classes is not None:
        parts.append(classes.reshape(len(boxes), N_CLASSES).astype(np.float32))
    return np.concatenate(parts, axis=1)


def detected_proposals(image: np.ndarray, cfg: ImageConfig, detector: Detector) -> np.ndarray:
    """An (H, W, 3) uint8 RGB image → its proposals (P, 5) from the COCO detector: with ``cfg.proposals``
    "detector" every detection (best first), with "detector_topup" the detections scoring at least
    ``cfg.detector_floor`` followed by the image's selective-search boxes (unscored, NaN). With
    ``cfg.detector_classes`` each row also carries its class scores (P, 95; zeros for selective search's)."""
    topup = cfg.proposals == "detector_topup"
    found = detector.detect(image, floor=cfg.detector_floor if topup else CANDIDATE_FLOOR, nms_iou=cfg.nms_iou)
    classes = cfg.detector_classes
    dets = with_priors(found.boxes, found.scores, found.class_scores if classes else None)
    if not topup:
        return dets
    boxes = propose_boxes(image, cfg)
    return np.concatenate([dets, with_priors(boxes, None, np.zeros((len(boxes), N_CLASSES), np.float32)
                                                          if classes else None)])


def grid_boxes(width: int, height: int) -> np.ndarray:
    """The 19 fixed fallback boxes (19, 4) float32 used when too few proposals survive."""
    frac = np.asarray(_GRID_FRACTIONS, dtype=np.float32)
    return frac * np.asarray([width, height, width, height], dtype=np.float32)


def full_box(width: int, height: int) -> np.ndarray:
    """(1, 4) float32 box covering the whole image."""
    return np.asarray([[0.0, 0.0, width, height]], dtype=np.float32)


def select_regions(
    proposals: np.ndarray, scores: np.ndarray, width: int, height: int, cfg: ImageConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Proposals (P, 4) with scores (P,) → the kept regions (cfg.n_regions, 4), best first, and the row of
    ``proposals`` each came from (cfg.n_regions,) int64, -1 for a box of the fallback grid.

    Near-copies of the whole image are dropped, then NMS at ``cfg.nms_iou``; missing slots are
    filled from the fixed grid (grid boxes that overlap a kept box less than nms_iou first).
    """
    n = cfg.n_regions
    kept = np.zeros((0, 4), np.float32)
    rows = np.zeros((0,), np.int64)
    if len(proposals):
        b = np.asarray(proposals, np.float32).reshape(-1, 4)
        s = np.asarray(scores, np.float32)
        index = np.flatnonzero(box_iou(b, full_box(width, height))[:, 0] <= FULL_FRAME_DUP_IOU)
        keep = nms(b[index], s[index], cfg.nms_iou, limit=n)
        kept = b[index[keep]]
        rows = index[keep].astype(np.int64)
    return _filled(kept, rows, width, height, cfg)


def select_split_regions(proposals: np.ndarray, head_scores: np.ndarray, ranker_scores: np.ndarray,
                         width: int, height: int, cfg: ImageConfig) -> tuple[np.ndarray, np.ndarray]:
    """``select_regions`` for regions split between two choosers (``cfg.head_regions``): the first
    ``cfg.head_regions`` by ``head_scores`` among the proposals with sides of at least ``cfg.head_min_box_frac``,
    then the free slots by ``ranker_scores`` among them all, each box by NMS against every box kept before
    it (the head's included). Near-copies of the whole image are dropped; the grid fills missing slots."""
    n = cfg.n_regions
    b = np.asarray(proposals, np.float32).reshape(-1, 4)
    if not len(b):
        return _filled(np.zeros((0, 4), np.float32), np.zeros((0,), np.int64), width, height, cfg)
    usable = box_iou(b, full_box(width, height))[:, 0] <= FULL_FRAME_DUP_IOU
    pool = np.flatnonzero(usable & sides_at_least(b, width, height, cfg.head_min_box_frac))
    first = pool[nms(b[pool], np.asarray(head_scores, np.float32)[pool], cfg.nms_iou, limit=min(cfg.head_regions, n))]
    rest = np.setdiff1d(np.flatnonzero(usable), first)
    candidates = np.concatenate([first, rest])
    # the head's boxes come first (2, above every ranked score) and keep their order; NMS among them
    # was done at the same threshold, so none of them drops another
    scores = np.concatenate([np.full(len(first), 2.0, np.float32), np.asarray(ranker_scores, np.float32)[rest]])
    keep = candidates[nms(b[candidates], scores, cfg.nms_iou, limit=n)]
    return _filled(b[keep], keep.astype(np.int64), width, height, cfg)


def _filled(kept: np.ndarray, rows: np.ndarray, width: int, height: int, cfg: ImageConfig
            ) -> tuple[np.ndarray, np.ndarray]:
    """The kept regions and their rows, the missing slots filled from the fixed grid (grid boxes that overlap a
    kept box less than nms_iou first; their rows -1)."""
    n = cfg.n_regions
    if len(kept) >= n:
        return kept[:n], rows[:n]
    grid = grid_boxes(width, height)
    if len(kept):
        overlap = box_iou(grid, kept).max(axis=1)
        order = np.concatenate([np.flatnonzero(overlap < cfg.nms_iou), np.flatnonzero(overlap >= cfg.nms_iou)])
        grid = grid[order]
    filled = grid[: n - len(kept)]
    return (np.concatenate([kept, filled]).astype(np.float32),
            np.concatenate([rows, np.full(len(filled), -1, np.int64)]))
