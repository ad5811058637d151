"""ONNX Runtime sessions of the runtime's graphs (the image backbone, MiniLM), and where graphs are kept.

The runtime only runs graphs: a release ships the graphs its model needs (model/released/), and the
graphs of other settings (a float backbone, a larger or fine-tuned one) are exported once into the graph
folder of the run (model/places.py `Places.graphs`) by the torch side (training/nets/), where torch is installed.
Sessions run on the CPU, or on ONNX Runtime's CUDA provider where onnxruntime-gpu is installed and the
device policy (model/device.py) puts the model on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fragsearch.model.resources import usable_cpus

logger = logging.getLogger(__name__)

OPSET = 17
_threads: list[int] = []  # the process's intra-op thread count for new sessions (set_threads), empty: the CPUs
_numeric: list[int] = []  # the threads of the process's products (limit_numeric_threads), empty: the CPUs


def set_threads(n: int) -> None:
    """Run new ONNX Runtime sessions and OpenCV on ``n`` threads (one per worker process when several share
    the CPU); torch too, where this process has imported it (training)."""
    n = max(1, int(n))
    _threads[:] = [n]
    with contextlib.suppress(ImportError):
        import cv2

        cv2.setNumThreads(n)
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
        with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
            torch.set_num_interop_threads(n)


def default_threads() -> int:
    """Intra-op threads of a new session: `set_threads`' count, else the CPUs this process may use."""
    if _threads:
        return _threads[0]
    return usable_cpus()


def request_threads(slots: int, cpus: int | None = None) -> int:
    """Threads of one request's numeric work in a server that runs `slots` requests at once: its share of the
    CPUs, at least one. Each product on every core, with several requests running, has the cores' threads
    contend: on 2 cores with 8 clients, one thread each served 1.6 times the searches a second
    (docs/benchmarks/service.md)."""
    return max(1, (usable_cpus() if cpus is None else cpus) // max(1, slots))


def limit_numeric_threads(n: int) -> dict[str, int]:
    """NumPy's BLAS, the OpenMP pools of this process (FAISS's among them) and the large products (model/product.py)
    to `n` threads from now on; what each library now runs on, by its kind ({"blas": 1, "openmp": 1, "products": 1})."""
    from threadpoolctl import threadpool_info, threadpool_limits

    n = max(1, int(n))
    _numeric[:] = [n]
    threadpool_limits(limits=n)
    with contextlib.suppress(ImportError):
        import faiss

        faiss.omp_set_num_threads(n)
    return {**{str(i["user_api"]): int(i["num_threads"]) for i in threadpool_info()}, "products": n}


def numeric_threads() -> int:
    """Threads of one of the process's large products (model/product.py): `limit_numeric_threads`' count, else
    the CPUs this process may use."""
    return _numeric[0] if _numeric else usable_cpus()


def providers(device: str = "cpu") -> list[str]:
    """ONNX Runtime's execution providers for a device ('cpu', 'cuda', 'cuda:N'): the CUDA provider first
    on a GPU where onnxruntime-gpu has it, the CPU provider always."""
    import onnxruntime as ort

    out = ["CPUExecutionProvider"]
    if str(device).startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        out.insert(0, "CUDAExecutionProvider")
    return out


def session_options(threads: int | None = None) -> Any:
    """ONNX Runtime's session options of the project: ``threads`` intra-op threads (default:
    `default_threads`), one inter-op thread, warnings and errors only."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, threads or default_threads())
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return opts


def session(path: Path | str | bytes, device: str = "cpu", threads: int | None = None, options: Any = None,
            disabled: Sequence[str] = ()) -> Any:
    """An ONNX Runtime session of the graph file ``path`` (or serialized graph bytes) on ``device``, with
    ``options`` (default: `session_options(threads)`), without the graph optimizers named in ``disabled``."""
    import onnxruntime as ort

    model = path if isinstance(path, bytes) else str(path)
    return ort.InferenceSession(model, options or session_options(threads), providers=providers(device),
                                disabled_optimizers=list(disabled) or None)
