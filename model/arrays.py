"""The few array operations the shared computations (model/score.py, model/calibration.py) need beyond the
array API standard, for NumPy (the runtime) and torch (training) alike.

Everything else those modules compute is written once against the standard namespace of their inputs
(`namespace`, array-api-compat): the same code runs on NumPy arrays in the service and on torch tensors,
with autograd, on any device, in training.
"""

from __future__ import annotations

import zipfile
from typing import IO, Any

import array_api_compat
import numpy as np

Array = Any  # a NumPy array or a torch tensor


def namespace(*arrays: Array) -> Any:
    """The array API namespace of the arrays (NumPy's or torch's, through array-api-compat)."""
    return array_api_compat.array_namespace(*arrays)


def is_torch(x: Array) -> bool:
    return bool(array_api_compat.is_torch_array(x))


def segment_sum(x: Array, owner: Array, n: int, axis: int = 0) -> Array:
    """Sums of the slices of `x` along `axis` by their owner (0 .. n - 1), (…, n, …): torch's index_add
    (differentiable), NumPy's bincount (one dimension) or reduceat over sorted owners (the layout
    model/score.py makes: each item's fragments in a row)."""
    if is_torch(x):
        shape = list(x.shape)
        shape[axis] = n
        return x.new_zeros(shape).index_add(axis, owner, x)
    x = np.asarray(x)
    owner = np.asarray(owner)
    if x.ndim == 1:
        return np.bincount(owner, weights=x, minlength=n).astype(x.dtype, copy=False)
    moved = np.moveaxis(x, axis, 0)
    out = np.zeros((n, *moved.shape[1:]), dtype=x.dtype)
    if len(owner):
        if np.all(owner[1:] >= owner[:-1]):
            starts = np.flatnonzero(np.concatenate([[True], owner[1:] != owner[:-1]]))
            out[owner[starts]] = np.add.reduceat(moved, starts, axis=0)
        else:
            np.add.at(out, owner, moved)
    return np.moveaxis(out, 0, axis)


def counts(owner: Array, n: int, like: Array) -> Array:
    """How many slices each owner (0 .. n - 1) has, (n,) in `like`'s float dtype (and on its device)."""
    if is_torch(owner):
        import torch

        return torch.bincount(owner, minlength=n).to(like.dtype)
    return np.bincount(np.asarray(owner), minlength=n).astype(np.asarray(like).dtype)


def contiguous(x: Array) -> Array:
    """`x` laid out row-major in memory (a copy only when it is not)."""
    return x.contiguous() if is_torch(x) else np.ascontiguousarray(x)


def to_numpy(x: Array) -> np.ndarray:
    """A NumPy view (or, for a tensor off the CPU or with a gradient, a copy) of an array."""
    if is_torch(x):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def write_npz(fh: IO[bytes], arrays: dict[str, np.ndarray]) -> None:
    """`arrays` as an .npz (what np.load reads) with fixed entry dates and in the given order: the same arrays
    give the same bytes, so a file made again has the same sha256."""
    with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as zf:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with zf.open(info, "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.ascontiguousarray(value), allow_pickle=False)
