"""Box operations in NumPy (float32): pairwise IoU, greedy non-maximum suppression and RoIAlign, each equal to
its torchvision.ops counterpart on the CPU (``box_iou``, ``nms``, ``roi_align``), so that regions and their
features are the same with or without torch installed.

Boxes are ``[x0, y0, x1, y1]`` rows. Equal means: the same float32 arithmetic in the same order (the kept
indices of ``nms`` identical, ties and equal scores included; ``roi_align``'s samples, weights and sums as its
CPU kernel computes them).
"""

from __future__ import annotations

import numpy as np

_CHUNK_VALUES = 2**19  # roi_align works on this many output values at a time (2 MB of float32 per buffer)


def box_area(boxes: np.ndarray) -> np.ndarray:
    """Boxes (N, 4) → their areas (N,) float32: (x1 - x0) * (y1 - y0), negative for an inverted box."""
    b = np.asarray(boxes, np.float32).reshape(-1, 4)
    return ((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])).astype(np.float32)


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Boxes a (N, 4) and b (M, 4) → their pairwise intersection over union (N, M) float32 (a NaN coordinate
    gives NaN; an empty union 0/0 gives NaN)."""
    a = np.asarray(a, np.float32).reshape(-1, 4)
    b = np.asarray(b, np.float32).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])  # (N, M, 2)
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = np.maximum(rb - lt, np.float32(0))
    inter = wh[:, :, 0] * wh[:, :, 1]
    union = box_area(a)[:, None] + box_area(b)[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return (inter / union).astype(np.float32)


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float, limit: int | None = None) -> np.ndarray:
    """Greedy non-maximum suppression: boxes (N, 4) with scores (N,) → the indices of the kept boxes (K,) int64,
    best score first. A box is dropped when its IoU with a kept, better-ranked box is above ``iou`` (compared
    in float64, as the threshold is given). Boxes are visited in ``score_order`` (NaN first, equal scores by
    index). ``limit``: stop after that many kept boxes (the first ``limit`` of the full answer)."""
    b = np.ascontiguousarray(np.asarray(boxes, np.float32).reshape(-1, 4))
    s = np.asarray(scores, np.float32).reshape(-1)
    if len(b) != len(s):
        raise ValueError(f"nms: {len(b)} boxes but {len(s)} scores")
    if not len(b):
        return np.zeros((0,), np.int64)
    x0, y0, x1, y1 = (np.ascontiguousarray(b[:, k]) for k in range(4))
    areas = (x1 - x0) * (y1 - y0)
    threshold = float(iou)
    remaining = score_order(s)
    keep: list[int] = []
    zero = np.float32(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        while remaining.size and (limit is None or len(keep) < limit):
            i = int(remaining[0])
            keep.append(i)
            rest = remaining[1:]
            # std::max(a, b) is b if a < b else a, std::min(a, b) is b if b < a else a (NaN as C++ has it)
            xx0 = np.where(x0[i] < x0[rest], x0[rest], x0[i])
            yy0 = np.where(y0[i] < y0[rest], y0[rest], y0[i])
            xx1 = np.where(x1[rest] < x1[i], x1[rest], x1[i])
            yy1 = np.where(y1[rest] < y1[i], y1[rest], y1[i])
            dw, dh = xx1 - xx0, yy1 - yy0
            inter = np.where(zero < dw, dw, zero) * np.where(zero < dh, dh, zero)
            ovr = inter / (areas[i] + areas[rest] - inter)
            remaining = rest[~(ovr.astype(np.float64) > threshold)]
    return np.asarray(keep, np.int64)


def score_order(scores: np.ndarray) -> np.ndarray:
    """Scores (N,) → the indices (N,) int64 by descending score, NaN first, equal scores (0.0 and -0.0 too) in
    index order: a stable descending sort."""
    s = np.asarray(scores, np.float32).reshape(-1)
    return np.lexsort((np.arange(len(s)), -s, ~np.isnan(s))).astype(np.int64)


# -- RoIAlign -----------------------------------------------------------------------------------------------


def roi_align(fmap: np.ndarray, boxes: np.ndarray, output_size: int | tuple[int, int], spatial_scale: float,
              sampling_ratio: int, aligned: bool = True) -> np.ndarray:
    """RoIAlign of one feature map: fmap (C, H, W) and boxes (N, 4) in input coordinates → (N, C, ph, pw)
    float32, each output bin the mean of bilinear samples of the map.

    A box is scaled by ``spatial_scale`` (and shifted by half a cell with ``aligned``; without it a box is at
    least one cell wide); each of its ph x pw bins takes ``sampling_ratio`` samples per side, or, when
    ``sampling_ratio`` <= 0, ceil(bin side) per side (none for an empty or inverted box: zeros). A sample past
    the map by more than one cell (or NaN) counts as zero; one within a cell of the border takes the border's
    values."""
    f = np.asarray(fmap, np.float32)
    if f.ndim != 3:
        raise ValueError(f"roi_align: fmap must be (C, H, W), got {f.shape}")
    c, h, w = f.shape
    ph, pw = (output_size, output_size) if isinstance(output_size, int) else output_size
    b = np.asarray(boxes, np.float32).reshape(-1, 4)
    n = len(b)
    if n == 0 or c == 0:
        return np.zeros((n, c, ph, pw), np.float32)
    scale = np.float32(spatial_scale)
    offset = np.float32(0.5 if aligned else 0.0)
    start_x, start_y = b[:, 0] * scale - offset, b[:, 1] * scale - offset
    width = b[:, 2] * scale - offset - start_x
    height = b[:, 3] * scale - offset - start_y
    if not aligned:  # std::max(side, 1)
        one = np.float32(1)
        width = np.where(width < one, one, width)
        height = np.where(height < one, one, height)
    bin_h, bin_w = height / np.float32(ph), width / np.float32(pw)
    grid_h, grid_w = _grid(bin_h, sampling_ratio), _grid(bin_w, sampling_ratio)
    count = np.maximum(grid_h * grid_w, 1).astype(np.float32)  # (N,)
    ys = _axis_samples(start_y, bin_h, grid_h, ph, h)  # per (box, bin, sample) along y
    xs = _axis_samples(start_x, bin_w, grid_w, pw, w)
    table = np.ascontiguousarray(f.reshape(c, h * w).T)  # (H * W, C): one row per map cell
    samples = [_corners(ys, xs, iy, ix, grid_h, grid_w, w)
               for iy in range(ys.low.shape[2]) for ix in range(xs.low.shape[2])]
    out = np.empty((n, c, ph, pw), np.float32)
    step = max(1, _CHUNK_VALUES // (ph * pw * c))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        acc = np.zeros((hi - lo, ph, pw, c), np.float32)
        part, term = np.empty_like(acc), np.empty_like(acc)
        for cells, weights in samples:  # in the kernel's order: iy, then ix
            if not weights[:, lo:hi].any():
                continue  # no box of this chunk has this sample: it would add zeros
            # ((w1 v1 + w2 v2) + w3 v3) + w4 v4, then added to the bin's running sum
            np.take(table, cells[0, lo:hi], axis=0, out=part)
            part *= weights[0, lo:hi, :, :, None]
            for k in range(1, 4):
                np.take(table, cells[k, lo:hi], axis=0, out=term)
                term *= weights[k, lo:hi, :, :, None]
                part += term
            acc += part
        acc /= count[lo:hi, None, None, None]
        out[lo:hi] = acc.transpose(0, 3, 1, 2)
    return out


def _corners(ys: _Samples, xs: _Samples, iy: int, ix: int, grid_h: np.ndarray, grid_w: np.ndarray,
             width: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample (iy, ix) of every bin of every box → the four map cells it reads (4, N, ph, pw) int64 and their
    bilinear weights (4, N, ph, pw) float32 (cell 0 and weight 0 where the box has no such sample, or the
    sample is off the map)."""
    inside = (ys.inside[:, :, None, iy] & xs.inside[:, None, :, ix]
              & (iy < grid_h)[:, None, None] & (ix < grid_w)[:, None, None])  # (N, ph, pw)
    yl, yh = ys.low[:, :, None, iy], ys.high[:, :, None, iy]
    xl, xh = xs.low[:, None, :, ix], xs.high[:, None, :, ix]
    ly, hy = ys.frac[:, :, None, iy], ys.rest[:, :, None, iy]
    lx, hx = xs.frac[:, None, :, ix], xs.rest[:, None, :, ix]
    cells = np.stack([yl * width + xl, yl * width + xh, yh * width + xl, yh * width + xh])
    weights = np.stack([hy * hx, hy * lx, ly * hx, ly * lx]).astype(np.float32)
    return np.where(inside, cells, 0).astype(np.intp), np.where(inside, weights, np.float32(0))


def _grid(bin_side: np.ndarray, sampling_ratio: int) -> np.ndarray:
    """Samples per bin side (N,) int64: ``sampling_ratio``, or ceil(bin side) when it is <= 0 (0 for NaN)."""
    if sampling_ratio > 0:
        return np.full(bin_side.shape, int(sampling_ratio), np.int64)
    up = np.ceil(np.nan_to_num(bin_side, nan=0.0, posinf=0.0, neginf=0.0))
    return up.astype(np.int64)


class _Samples:
    """Bilinear sample positions along one axis, (N, bins, G) each: the lower and upper cell, the weight of
    the upper cell (frac) and of the lower (rest), and whether the coordinate is on the map at all."""

    def __init__(self, low: np.ndarray, high: np.ndarray, frac: np.ndarray, rest: np.ndarray,
                 inside: np.ndarray) -> None:
        self.low, self.high, self.frac, self.rest, self.inside = low, high, frac, rest, inside


def _axis_samples(start: np.ndarray, bin_side: np.ndarray, grid: np.ndarray, bins: int, size: int) -> _Samples:
    n = len(start)
    g = max(1, int(grid.max(initial=0)))
    p = np.arange(bins, dtype=np.float32)[None, :, None]  # (1, bins, 1)
    k = (np.arange(g, dtype=np.float32) + np.float32(0.5))[None, None, :]  # (1, 1, G)
    per = np.maximum(grid, 1).astype(np.float32)[:, None, None]
    s, side = start[:, None, None], bin_side[:, None, None]
    coord = (s + p * side) + (k * side) / per  # (N, bins, G)
    coord = np.broadcast_to(coord, (n, bins, g)).astype(np.float32)
    inside = (coord >= -1.0) & (coord <= size)
    at = np.where(inside & (coord > 0), coord, np.float32(0))
    low = at.astype(np.int64)
    last = low >= size - 1
    low = np.where(last, size - 1, low)
    high = np.where(last, size - 1, low + 1)
    at = np.where(last, low.astype(np.float32), at)
    frac = (at - low.astype(np.float32)).astype(np.float32)
    rest = (np.float32(1) - frac).astype(np.float32)
    return _Samples(low, high, frac, rest, inside)
