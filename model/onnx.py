"""ONNX graphs of the frozen networks (the image backbone, MiniLM) and their ONNX Runtime sessions.

A graph is exported from the packaged torch weights on first use into the graph folder
($FRAGSEARCH_ARTIFACTS/cache/graphs), written atomically so that concurrent processes never read
half a file, and run by ONNX Runtime on the CPU (or its CUDA provider where onnxruntime-gpu is
installed). Float graphs give the torch outputs to ~1e-5 at a fraction of the CPU time.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from model.atomic import atomic_path
from model.config import default_artifacts_dir

logger = logging.getLogger(__name__)

OPSET = 17
_lock = threading.Lock()


def graph_dir() -> Path:
    """Where exported graphs are kept: $FRAGSEARCH_ARTIFACTS/cache/graphs."""
    return default_artifacts_dir() / "cache" / "graphs"


def export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: Sequence[str],
           outputs: Sequence[str], dynamic: dict[str, dict[int, str]]) -> Path:
    """``module`` traced on ``args`` into the ONNX file ``path``, unless it is there already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock:
        if not path.is_file():
            logger.info("exporting %s to ONNX", path.name)
            with atomic_path(path) as tmp, torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(module, args, str(tmp), input_names=list(inputs), output_names=list(outputs),
                                  dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)
    return path


def session(path: Path, device: torch.device | str = "cpu", threads: int | None = None) -> Any:
    """An ONNX Runtime session of ``path`` with ``threads`` intra-op threads (default: torch's count)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, threads or torch.get_num_threads())
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if torch.device(device).type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), opts, providers=providers)
