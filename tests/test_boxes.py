"""The NumPy box operations (model/boxes.py) against torchvision.ops' CPU kernels: the same IoUs and RoIAlign
outputs bit for bit, the same kept indices from NMS (ties, equal scores, NaN and degenerate boxes included).
torchvision is the trainer's (the dev environment has it); the module under test never imports it."""

from __future__ import annotations

import numpy as np
import pytest

from model.boxes import box_iou, nms, roi_align, score_order

torch = pytest.importorskip("torch")
ops = pytest.importorskip("torchvision.ops")


def random_boxes(rng: np.random.Generator, n: int, lo: float = -20.0, hi: float = 120.0) -> np.ndarray:
    """(n, 4) float32 boxes, some past the border (lo < 0, hi past a 100-wide picture), a tenth of zero width,
    a tenth inverted (x1 < x0 or y1 < y0)."""
    xy = rng.uniform(lo, hi, (n, 2))
    wh = rng.uniform(0.5, 80.0, (n, 2))
    boxes = np.concatenate([xy, xy + wh], axis=1).astype(np.float32)
    tenth = max(1, n // 10)
    boxes[:tenth, 2] = boxes[:tenth, 0]  # zero width
    boxes[tenth : 2 * tenth, 3] = boxes[tenth : 2 * tenth, 1] - np.float32(3.0)  # inverted
    return boxes


def torch_nms(boxes: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    return ops.nms(torch.from_numpy(boxes), torch.from_numpy(scores), iou).numpy()


@pytest.mark.parametrize("seed", range(6))
def test_box_iou_is_torchvisions(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = random_boxes(rng, 150), random_boxes(rng, 40)
    b[0] = a[40]  # an identical pair: IoU 1
    b[1] = [5, 5, 5, 5]  # a point: 0 / 0 against another point
    a[4] = [5, 5, 5, 5]
    mine = box_iou(a, b)
    theirs = ops.box_iou(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    assert mine.dtype == np.float32 and mine.shape == (150, 40)
    np.testing.assert_array_equal(mine, theirs)
    assert mine[40, 0] == 1.0 and np.isnan(mine[4, 1])


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n", [1, 7, 17, 64, 300, 1500])
def test_nms_keeps_torchvisions_indices(n: int, ties: bool) -> None:
    """Random boxes; with ``ties`` the scores take four values only, so most of them are equal."""
    rng = np.random.default_rng(n + 1000 * ties)
    boxes = random_boxes(rng, n, 0.0, 60.0)  # crowded: many overlaps
    scores = (rng.integers(0, 4, n) / 4).astype(np.float32) if ties else rng.random(n).astype(np.float32)
    for iou in (0.0, 0.3, 0.5, 0.7, 1.0):
        expected = torch_nms(boxes, scores, iou)
        kept = nms(boxes, scores, iou)
        assert kept.dtype == np.int64
        np.testing.assert_array_equal(kept, expected)
        np.testing.assert_array_equal(nms(boxes, scores, iou, limit=5), expected[:5])
    if ties and n >= 17:
        assert len(np.unique(scores)) < n


def test_nms_on_equal_scores_and_duplicate_boxes_keeps_the_first_index() -> None:
    rng = np.random.default_rng(7)
    box = np.asarray([[10, 10, 50, 50]], np.float32)
    boxes = np.concatenate([np.repeat(box, 40, axis=0), random_boxes(rng, 40)])
    scores = np.full(len(boxes), 0.5, np.float32)
    scores[::7] = 0.25
    expected = torch_nms(boxes, scores, 0.5)
    np.testing.assert_array_equal(nms(boxes, scores, 0.5), expected)
    assert expected[0] == 1  # index 0 scores lower (0.25): the first of the equal best is index 1
    # -0.0 and 0.0 are equal scores
    signed = np.asarray([0.0, -0.0, 0.0, -0.0], np.float32)
    spread = np.asarray([[0, 0, 1, 1], [2, 0, 3, 1], [4, 0, 5, 1], [6, 0, 7, 1]], np.float32)
    np.testing.assert_array_equal(nms(spread, signed, 0.5), torch_nms(spread, signed, 0.5))


def test_nms_nan_scores_and_boxes_as_torchvision() -> None:
    rng = np.random.default_rng(3)
    boxes = random_boxes(rng, 60, 0.0, 50.0)
    boxes[5, 0] = np.nan
    boxes[9, 3] = np.nan
    scores = rng.random(60).astype(np.float32)
    scores[[2, 11, 30]] = np.nan
    for iou in (0.2, 0.5):
        np.testing.assert_array_equal(nms(boxes, scores, iou), torch_nms(boxes, scores, iou))
    order = torch.from_numpy(scores).sort(dim=0, descending=True, stable=True).indices.numpy()
    np.testing.assert_array_equal(score_order(scores), order)
    assert list(score_order(scores)[:3]) == [2, 11, 30]


def test_nms_threshold_is_compared_as_given() -> None:
    """An IoU that equals the float32 rounding of the threshold but lies above the threshold itself (0.3 rounds
    up in float32) is suppressed, as torchvision compares in double precision."""
    a = np.asarray([[0, 0, 10, 10]], np.float32)
    width = np.float32(0.0)
    for w in np.linspace(3.0, 7.0, 4001, dtype=np.float32):  # find a box whose IoU is float32(0.3) exactly
        if box_iou(a, np.asarray([[0, 0, 10, w]], np.float32))[0, 0] == np.float32(0.3):
            width = w
            break
    assert width > 0
    boxes = np.asarray([[0, 0, 10, 10], [0, 0, 10, width]], np.float32)
    scores = np.asarray([1.0, 0.5], np.float32)
    np.testing.assert_array_equal(nms(boxes, scores, 0.3), torch_nms(boxes, scores, 0.3))
    assert list(nms(boxes, scores, 0.3)) == [0]


def test_nms_of_nothing() -> None:
    assert nms(np.zeros((0, 4), np.float32), np.zeros((0,), np.float32), 0.5).shape == (0,)
    with pytest.raises(ValueError, match="scores"):
        nms(np.zeros((3, 4), np.float32), np.zeros((2,), np.float32), 0.5)


@pytest.mark.parametrize("size", [(7, 7), (14, 14), (5, 9), (1, 1), (2, 3)])
@pytest.mark.parametrize("sampling", [0, 1, 2])
@pytest.mark.parametrize("aligned", [True, False])
def test_roi_align_is_torchvisions(size: tuple[int, int], sampling: int, aligned: bool) -> None:
    """Random boxes on a 100-pixel-wide input, past its border, zero-width and inverted among them, at two
    output sizes: the same float32 values bit for bit."""
    h, w = size
    rng = np.random.default_rng(h * 100 + w + 10 * sampling + aligned)
    fmap = rng.standard_normal((5, h, w)).astype(np.float32)
    boxes = random_boxes(rng, 50)
    scale = w / 100.0
    for output in (3, (2, 4)):
        mine = roi_align(fmap, boxes, output, scale, sampling, aligned)
        theirs = ops.roi_align(torch.from_numpy(fmap)[None], [torch.from_numpy(boxes)], output, scale, sampling,
                               aligned).numpy()
        assert mine.dtype == np.float32 and mine.shape == theirs.shape
        np.testing.assert_array_equal(mine, theirs)


def test_roi_align_adaptive_sampling_of_large_boxes_and_none() -> None:
    """sampling_ratio 0 on boxes many cells wide (several samples per bin, the count different per box), on a
    larger map with many channels, as the extractor pools its kept regions; and no boxes at all."""
    rng = np.random.default_rng(11)
    fmap = rng.standard_normal((64, 14, 14)).astype(np.float32)
    xy = rng.uniform(0, 300, (30, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(5, 448, (30, 2))], axis=1).astype(np.float32)
    mine = roi_align(fmap, boxes, 3, 14 / 448, 0)
    theirs = ops.roi_align(torch.from_numpy(fmap)[None], [torch.from_numpy(boxes)], 3, 14 / 448, 0, True).numpy()
    np.testing.assert_array_equal(mine, theirs)
    assert roi_align(fmap, np.zeros((0, 4), np.float32), 3, 1.0, 0).shape == (0, 64, 3, 3)
    with pytest.raises(ValueError, match="fmap"):
        roi_align(fmap[None], boxes, 3, 1.0, 0)
