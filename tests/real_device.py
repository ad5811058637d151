"""A pytest plugin for a machine with a GPU: tests/other_device.py's stand-in device replaced by the real
one, so that tests/test_device_mixing.py runs every path on CUDA against the CPU (tools/gpu_check.py loads
it with `-p tests.real_device`). CUDA's own checks then do what the stand-in's do: a tensor mixed across
devices raises torch's RuntimeError ("... on the same device"), `.numpy()` of a CUDA tensor a TypeError.
TF32 is off, so that both sides compute in fp32."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import tests.other_device


@contextlib.contextmanager
def _real_device() -> Iterator[torch.device]:
    yield torch.device("cuda", 0)


def _on_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def pytest_configure() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("tests.real_device needs a CUDA GPU")
    torch.backends.cudnn.allow_tf32 = False
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch 2.14's name for the switch
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
    tests.other_device.other_device = _real_device  # type: ignore[assignment]
    tests.other_device.on_device = _on_cuda  # type: ignore[assignment]
    tests.other_device.DeviceMixError = RuntimeError  # type: ignore[misc,assignment]
