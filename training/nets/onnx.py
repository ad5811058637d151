"""Exporting a torch module to an ONNX graph file, written atomically so that concurrent processes never
read half a file."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from fragsearch.model.atomic import atomic_path
from fragsearch.model.onnx import OPSET

logger = logging.getLogger(__name__)

_lock = threading.Lock()


def export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: Sequence[str],
           outputs: Sequence[str], dynamic: dict[str, dict[int, str]], fold: bool = True) -> Path:
    """``module`` traced on ``args`` into the ONNX file ``path``, unless it is there already. ``fold``:
    constant folding (off for a graph whose weights must stay the module's own tensors, by name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock:
        if not path.is_file():
            logger.info("exporting %s to ONNX", path.name)
            with atomic_path(path) as tmp, torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(module, args, str(tmp), input_names=list(inputs), output_names=list(outputs),
                                  dynamic_axes=dynamic, opset_version=OPSET, dynamo=False,
                                  do_constant_folding=fold)
    return path
