"""The extractor's NumPy box operations, head and pooling (model/boxes.py, model/image.py) give the fragments the
torch path gave (torchvision's roi_align, nms and box_iou, the torch head and softmax, torch's means) on real
Flickr8K dev photos: the same boxes, features equal to 1e-5 (both ranking the proposals by the NumPy head's
objectness, the torch head's checked against it to 1e-4: a near tie would otherwise swap two regions). The
torch path is kept here, as monkeypatches of the extractor's operations, for this comparison only
(torchvision is the trainer's; the dev environment has it)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from PIL import Image

import fragsearch.model.detector
import fragsearch.model.image
import fragsearch.model.proposals
from fragsearch.model.backbone import Backbone
from fragsearch.model.config import ImageConfig
from fragsearch.model.image import ImageFragments, RegionExtractor, image_proposals
from fragsearch.model.release import read_manifest
from fragsearch.model.variants import load_variant
from fragsearch.settings import default_data_dir

torch = pytest.importorskip("torch")
ops = pytest.importorskip("torchvision.ops")

PHOTOS = 3  # the first dev photos
FEATURE_RTOL = 1e-5


def _tv_nms(boxes: np.ndarray, scores: np.ndarray, iou: float, limit: int | None = None) -> np.ndarray:
    keep = ops.nms(torch.from_numpy(np.ascontiguousarray(boxes, np.float32)),
                   torch.from_numpy(np.ascontiguousarray(scores, np.float32)), iou).numpy()
    return keep if limit is None else keep[:limit]


def _tv_box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ops.box_iou(torch.from_numpy(np.asarray(a, np.float32)), torch.from_numpy(np.asarray(b, np.float32))).numpy()


def _tv_roi_pool(self: RegionExtractor, fmap: np.ndarray, boxes: np.ndarray, w: int, h: int, side: int,
                 sampling: int = fragsearch.model.image.FEATURE_SAMPLING) -> np.ndarray:
    scaled = torch.from_numpy(boxes * np.asarray([side / w, side / h, side / w, side / h], np.float32))
    rois = ops.roi_align(torch.from_numpy(fmap)[None], [scaled], output_size=fragsearch.model.image.ROI_OUTPUT,
                         spatial_scale=fmap.shape[-1] / side, sampling_ratio=sampling, aligned=True)
    return rois.mean(dim=(2, 3)).numpy()


def _tv_objectness(self: RegionExtractor, pooled: np.ndarray) -> np.ndarray:
    weight, bias = self.ranker.load_head()
    head = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(weight))
        head.bias.copy_(torch.from_numpy(bias))
        probs = torch.nn.functional.softmax(head(torch.from_numpy(pooled)).float(), dim=1)
    return probs.max(dim=1).values.numpy()


def _torch_pooled(self: Backbone, x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(self.feature_map(x)).mean(dim=(2, 3)).numpy()


@contextlib.contextmanager
def torch_ops(calls: Counter[str] | None = None, ranked_by: list[np.ndarray] | None = None) -> Iterator[None]:
    """The extractor's box operations, head, softmax and pooling as the torch path computed them (each call
    counted in ``calls`` by name). With ``ranked_by`` (the NumPy path's objectness of each call, in order), the
    torch head's objectness is checked against it and the regions are ranked by it: proposals whose scores
    differ in the last bits (a near tie) would otherwise swap places between the two paths, whichever is
    right."""
    counted = Counter[str]() if calls is None else calls

    def objectness(self: RegionExtractor, pooled: np.ndarray) -> np.ndarray:
        theirs = _tv_objectness(self, pooled)
        if ranked_by is None:
            return theirs
        want = ranked_by.pop(0)
        np.testing.assert_allclose(theirs, want, rtol=1e-4, atol=1e-6)
        return want

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counted[name] += 1
            return fn(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fragsearch.model.proposals, "nms", spy("nms", _tv_nms))
        mp.setattr(fragsearch.model.proposals, "box_iou", spy("box_iou", _tv_box_iou))
        mp.setattr(fragsearch.model.detector, "nms", spy("detector nms", _tv_nms))
        mp.setattr(RegionExtractor, "_roi_pool", spy("roi_align", _tv_roi_pool))
        mp.setattr(RegionExtractor, "_objectness", spy("objectness", objectness))
        mp.setattr(Backbone, "pooled", spy("pooled", _torch_pooled))
        yield


def photos(n: int = PHOTOS) -> list[Image.Image]:
    root = default_data_dir()
    if not (root / "dev.txt").is_file():
        pytest.skip(f"the Flickr8K data is not at {root}")
    names = [ln.strip() for ln in (root / "dev.txt").read_text().splitlines() if ln.strip()][:n]
    return [Image.open(root / "images" / name).convert("RGB") for name in names]


def both(cfg: ImageConfig, images: list[Image.Image], calls: Counter[str] | None = None
         ) -> tuple[list[ImageFragments], list[ImageFragments]]:
    """(NumPy, torch) fragments of the images with one extractor, the regions ranked by the NumPy path's
    objectness in both (the torch head's checked against it: `torch_ops`)."""
    extractor = RegionExtractor(cfg)
    scores: list[np.ndarray] = []
    numpy_objectness = RegionExtractor._objectness

    def recorded(self: RegionExtractor, pooled: np.ndarray) -> np.ndarray:
        out = numpy_objectness(self, pooled)
        scores.append(out)
        return out

    # selective search orders its boxes by the C library's rand(), seeded for each image: another thread of
    # this process calling rand() meanwhile (a client library's) reorders them, so both paths extract from the
    # proposals made once; the torch path makes its own too (the detector's NMS in torch) and must make as many
    proposals = [image_proposals(img, cfg, extractor.detector) for img in images]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RegionExtractor, "_objectness", recorded)
        mine = extractor.extract_proposed(images, proposals)
    with torch_ops(calls, ranked_by=scores):
        again = [image_proposals(img, cfg, extractor.detector) for img in images]
        assert [p.shape for p in again] == [p.shape for p in proposals]
        theirs = extractor.extract_proposed(images, proposals)
    assert not scores, "the torch path ranked as many proposal sets as the NumPy path"
    return mine, theirs


RELEASED = load_variant(read_manifest()["name"]).image
# name -> (settings, the torch operations its extraction calls)
SETTINGS = {
    # int8 crops of selective-search regions ranked by the head (one sample per bin)
    "released": (RELEASED, {"nms", "box_iou", "roi_align", "objectness", "pooled"}),
    # float roi features at 448: adaptive sampling of the kept regions
    "roi_align": (ImageConfig(), {"nms", "box_iou", "roi_align", "objectness"}),
    # the detector's NMS too
    "detector_topup": (dataclasses.replace(RELEASED, proposals="detector_topup"),
                       {"nms", "box_iou", "detector nms", "roi_align", "objectness", "pooled"}),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_fragments_are_the_torch_paths_on_real_photos(name: str) -> None:
    cfg, used = SETTINGS[name]
    images = photos()
    calls: Counter[str] = Counter()
    mine, theirs = both(cfg, images, calls)
    assert set(calls) == used, "the torch path ran the torch operations"
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_array_equal(a.boxes, b.boxes)
        assert a.features.dtype == np.float32 and a.features.shape == b.features.shape
        np.testing.assert_allclose(a.features, b.features, rtol=FEATURE_RTOL,
                                   atol=FEATURE_RTOL * np.abs(b.features).max())
