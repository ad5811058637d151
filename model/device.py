"""The one device setting: ``auto`` | ``cpu`` | ``cuda`` (or ``cuda:N``), resolved once.

``auto`` is the GPU when torch sees one, else the CPU. ``cuda`` on a machine without a usable GPU
is a `DeviceError` (one clear line at start-up), never a silent fall-back: a service configured for
a GPU that runs on the CPU would be an order of magnitude slower without saying so.

Everything that computes takes the resolved device: checkpoints load on the CPU and move to it
(model/bundle.py), training and calibration put their batches on it, MiniLM and the image
backbone run on it, and FAISS uses its GPU indexes when the device is a GPU and faiss has them.
"""

from __future__ import annotations

import re

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class DeviceError(ValueError):
    """The device setting names something this machine does not have (or nothing valid)."""


def check_device_name(name: str) -> str:
    """`name` normalised (lower case, trimmed) if it is auto, cpu, cuda or cuda:N; DeviceError otherwise."""
    value = str(name).strip().lower()
    if not _PATTERN.match(value):
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, not {name!r}")
    return value


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The torch device for a setting: auto -> cuda if available else cpu; cuda without a GPU raises."""
    if isinstance(name, torch.device):
        name = str(name)
    value = check_device_name(name)
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(value)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {value!r} was asked for, but torch sees no GPU here "
                              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}): "
                              "set the device to auto or cpu, or run where a GPU is visible")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {value!r} was asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
    return dev


def device_name(name: str | torch.device = "auto") -> str:
    """The resolved device as a string ('cpu', 'cuda', 'cuda:1'), for settings and CLI flags."""
    return str(resolve_device(name))


def is_gpu(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"
