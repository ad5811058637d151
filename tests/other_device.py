"""A second torch device on a machine that has only the CPU: tensors that say they are on `cuda:0`.

`other_device()` is a context in which `cuda` works as a device name without a GPU: factories called
with `device="cuda"`, `Tensor.to("cuda")` and `Module.to("cuda")` give tensors of the class `OnDevice`
(real CPU data that reports `cuda:0` as its device), and every torch call is checked as CUDA checks
it: an op that mixes an `OnDevice` tensor with a CPU tensor of one or more dimensions raises
"Expected all tensors to be on the same device" (CPU scalars, 0-d, are allowed, as CUDA allows them;
indices may stay on the CPU when the indexed tensor is on the device, as torch moves them), and
`.numpy()` of an `OnDevice` tensor raises as it does for a CUDA tensor. `.cpu()` / `.to("cpu")` copy
back. So a tensor made without `device=` and then mixed with the model's, or a `.numpy()` in the
middle of a computation on the device, fails here the way it fails on a GPU.

Unlike the `meta` device, the numbers are real: data-dependent code (`nonzero`, `.item()`, `if
t.any()`) runs, and results can be compared with the CPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda", 0)

_DEVICE_GET = torch.Tensor.device.__get__
_IS_CUDA_GET = torch.Tensor.is_cuda.__get__  # type: ignore[attr-defined]
# calls that take tensors of two devices on CUDA too
_NEUTRAL: set[Callable[..., Any]] = {torch._has_compatible_shallow_copy_type, torch.Tensor.copy_}
# indexing: CPU indices into a device tensor are allowed (device indices into a CPU tensor are not)
_INDEXING: set[Callable[..., Any]] = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
                                      torch.Tensor.index_put}


class OnDevice(torch.Tensor):
    """A CPU tensor that stands for one on `DEVICE` (torch functions see it as a plain tensor)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]


class DeviceMixError(RuntimeError):
    """An op mixed tensors of the device and of the CPU (what CUDA raises as a RuntimeError)."""


def _is_device(dev: object) -> bool:
    return isinstance(dev, str | torch.device) and torch.device(dev).type == DEVICE.type


def _retype(t: torch.Tensor, cls: type[torch.Tensor]) -> torch.Tensor:
    t.__class__ = cls  # in place: keeps autograd identity (a leaf stays a leaf, a parameter its gradient)
    return t


def _moved(src: torch.Tensor, to_device: bool, dtype: torch.dtype | None) -> torch.Tensor:
    """`src` as a new tensor on the device or on the CPU (a copy, as a real move is)."""
    if isinstance(src, OnDevice) == to_device and (dtype is None or dtype == src.dtype):
        return src
    out = src.to(dtype=dtype or src.dtype, copy=True)
    return _retype(out, OnDevice if to_device else torch.Tensor)


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func == _DEVICE_GET:
            return DEVICE if isinstance(args[0], OnDevice) else torch.device("cpu")
        if func == _IS_CUDA_GET:
            return isinstance(args[0], OnDevice)
        if func is torch.Tensor.to:
            dev, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            return _moved(args[0], isinstance(args[0], OnDevice) if dev is None else _is_device(dev), dtype)
        if func is torch.Tensor.cuda:
            return _moved(args[0], True, None)
        if func is torch.Tensor.cpu:
            return _moved(args[0], False, None)
        if func is torch.Tensor.numpy and isinstance(args[0], OnDevice):
            raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if _is_device(kwargs.get("device")):  # a factory (zeros, eye, arange, ...) asked for the device
            return self._on_device(func(*args, **{**kwargs, "device": "cpu"}), tensors)
        if not any(isinstance(t, OnDevice) for t in tensors):
            return func(*args, **kwargs)
        if func in _NEUTRAL:
            host: list[torch.Tensor] = []
        elif func in _INDEXING:
            host = [] if isinstance(args[0], OnDevice) else [args[0]]
        else:
            host = [t for t in tensors if not isinstance(t, OnDevice) and t.dim() > 0]
        if host:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise DeviceMixError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                 f"{DEVICE} and cpu! (in {name}: a CPU tensor of shape {tuple(host[0].shape)})")
        return self._on_device(func(*args, **kwargs), tensors)

    @staticmethod
    def _on_device(out: Any, inputs: list[torch.Tensor]) -> Any:
        """The tensors an op made, as device tensors (an input handed back keeps its own device)."""
        def one(t: Any) -> Any:
            if type(t) is torch.Tensor and not any(t is i for i in inputs):
                return _retype(t, OnDevice)
            return t

        return tree_map(one, out)


@contextlib.contextmanager
def other_device() -> Iterator[torch.device]:
    """Inside: `cuda` is a device whose tensors are checked as CUDA checks them (module docstring)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # Module.to keeps OnDevice parameters
    try:
        with _Mode():
            yield DEVICE
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def on_device(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor of the other device."""
    return isinstance(t, OnDevice)
