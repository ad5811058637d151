"""The one device setting: ``auto`` | ``cpu`` | ``cuda`` (or ``cuda:N``), resolved once.

``auto`` is the GPU when one is visible, else the CPU. ``cuda`` on a machine without a usable GPU is a
`DeviceError` (one clear line at start-up), never a silent fall-back: a service configured for a GPU that
runs on the CPU would be an order of magnitude slower without saying so.

A device is a plain string ('cpu', 'cuda', 'cuda:1'). What runs where, in one place:

- the runtime's graphs (MiniLM, the image backbone) run on ONNX Runtime on the device (its CUDA provider
  on a GPU, model/onnx.py);
- the small encoders, the calibration and the exact S_kl run in NumPy on the CPU: a query's products are a
  few MFLOP, less than a transfer to a GPU costs (`placement`'s "exact" and "prescore" calls);
- each call of a fragment index runs where `placement` says (FAISS's GPU copy for k-NN on a GPU host);
- image extraction runs where `extraction_device` says;
- training (training/nets, training/) puts its batches on the device as a torch device (`torch_device`).

Whether a GPU is visible is asked of torch where the process has it (training), else of FAISS (faiss-gpu)
and of ONNX Runtime's CUDA provider with an NVIDIA device node: the runtime never imports torch.
"""

from __future__ import annotations

import glob
import re
import sys
from typing import Any

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# Where a call of a fragment index runs (`placement`).
FAISS_GPU = "faiss-gpu"  # the FAISS index's GPU copy, one call at a time (index/gpu.py)
FAISS_CPU = "faiss-cpu"  # the FAISS index in host memory
MATRIX_CPU = "matrix-cpu"  # NumPy products over the stored vectors of a flat FAISS index
GPU_KNN_CPU_RANGE = "faiss-gpu-knn+cpu-range"  # FAISS contrib's range search: k-NN on the GPU copy, a CPU
#                                                range search for the queries whose results fill the k-NN
EXACT_CPU = "numpy-cpu"  # the exact S_kl (model/score.py) in NumPy on the CPU, over the stored fragments
CODES_CPU = "codes-cpu"  # NumPy on the CPU, beside the prescore codes held in host memory (index.codes)
CALLS = ("knn", "range", "exact", "prescore", "write")
FAISS_GPU_KINDS = ("flat", "ivf", "ivfpq")  # kinds FAISS can copy to a GPU (ivfpq: with 8-bit codes only)
FAISS_GPU_MAX_K = 2048  # FAISS's GPU k-selection limit: more neighbours per query are searched on the CPU
_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class DeviceError(ValueError):
    """The device setting names something this machine does not have (or nothing valid)."""


def check_device_name(name: str) -> str:
    """`name` normalised (lower case, trimmed) if it is auto, cpu, cuda or cuda:N; DeviceError otherwise."""
    value = str(name).strip().lower()
    if not _PATTERN.match(value):
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, not {name!r}")
    return value


def gpu_count() -> tuple[int, str]:
    """How many GPUs this process can use, and who said so: torch where it is imported (training), else
    faiss-gpu, else ONNX Runtime's CUDA provider and the NVIDIA device nodes; (0, why) without."""
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0, f"torch {torch.__version__}"
    try:
        import faiss

        n = int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0
        if n:
            return n, "faiss"
    except ImportError:
        pass
    try:
        import onnxruntime as ort
    except ImportError:
        return 0, "no onnxruntime"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return 0, f"onnxruntime {ort.__version__} without its CUDA provider (onnxruntime-gpu)"
    nodes = [p for p in glob.glob("/dev/nvidia[0-9]*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    return len(nodes), f"onnxruntime {ort.__version__} (CUDA provider) and {len(nodes)} NVIDIA device(s)"


def resolve_device(name: str = "auto") -> str:
    """The device for a setting: auto -> 'cuda' if a GPU is visible else 'cpu'; cuda without one raises."""
    value = check_device_name(str(name))
    if value == "cpu":
        return value
    count, why = gpu_count()
    if value == "auto":
        return "cuda" if count else "cpu"
    index = int(value.split(":")[1]) if ":" in value else 0
    if not count:
        raise DeviceError(f"device {value!r} was asked for, but no GPU is visible here ({why}): set the device "
                          "to auto or cpu, or run where a GPU is visible")
    if index >= count:
        raise DeviceError(f"device {value!r} was asked for, but {count} GPU(s) are visible ({why})")
    return value


def device_name(name: str = "auto") -> str:
    """The resolved device as a string ('cpu', 'cuda', 'cuda:1'), for settings and CLI flags."""
    return resolve_device(name)


def is_gpu(device: str | Any) -> bool:
    """Whether a device (a string, or a torch device in training) is a GPU."""
    return str(device).startswith("cuda")


def torch_device(name: str | Any = "auto") -> Any:
    """The torch device of a setting (training and the exporters only: imports torch)."""
    import torch

    return torch.device(name if isinstance(name, torch.device) else resolve_device(str(name)))


def extraction_device(device: str, workers: int) -> str:
    """Where image extraction runs: a pool of worker processes (`workers` > 1) on the CPU whatever the
    device; one extractor in the calling process on `device`.

    Every process that touches CUDA opens a context of its own (hundreds of MB of GPU memory before its
    first tensor), and a pool starts one worker per usable CPU: on a many-core GPU host the workers
    alone would fill the GPU before the service starts. The served model's backbone is the int8 graph
    on ONNX Runtime's CPU provider in any case, so the workers lose nothing but the small proposal
    scoring and region layers, which run beside it on the CPU.
    """
    return "cpu" if workers > 1 else str(device)


def fused_optimizer(params: list[Any]) -> bool:
    """Training's optimizer step runs as torch's fused kernel: every parameter on the CPU or a GPU (5x
    faster than the per-tensor step for Adam on the CPU); elsewhere (the `meta` device of the tests)
    the per-tensor step."""
    return bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)


def host_masks(device: Any) -> bool:
    """Training's dropout masks are drawn with NumPy on the host for a tensor on the CPU (torch's CPU
    Bernoulli draw is ~2.5x slower); on any other device torch draws them where the tensor is."""
    return bool(device.type == "cpu")


def faiss_gpu_kind(kind: str, nbits: int = 8) -> bool:
    """FAISS has a GPU version of this index kind: flat, ivf and ivfpq with 8-bit codes; not hnsw, nor
    ivfpq's 4-bit fast-scan codes (index_cpu_to_gpu refuses both)."""
    return kind in FAISS_GPU_KINDS and (kind != "ivfpq" or nbits == 8)


def placement(call: str, kind: str, gpu: bool, nbits: int = 8, k: int = 1) -> str:
    """Where one call of a fragment index runs: the device policy, in one place.

    call: "knn" (the k nearest fragments: candidate recall, region candidates), "range" (every
    fragment with a positive score: k' = 0), "exact" (the exact S_kl scan and re-rank), "prescore"
    (S_kl of many candidates' prescore codes, index.codes) or "write"
    (add, remove, train); kind: the FAISS kind searched now (`FaissCandidates.active_kind`); gpu: the model is
    on a GPU and faiss has one (`SearchSettings.use_gpu` and faiss-gpu); nbits: ivfpq's code bits;
    k: neighbours per query of a knn call.

    FAISS's GPU indexes have no range search, so a range search never runs on a GPU copy: a flat
    index answers it exactly with matrix products on the CPU (each fragment once, its positive scores
    summed), ivf / ivfpq through FAISS contrib's `range_search_gpu` (k-NN on the GPU, the CPU index
    for the queries whose k-NN are all positive), other kinds on the CPU. Exact scores and the prescore
    run in NumPy on the CPU, beside the stored fragments and codes in host memory (a query scores a few
    thousand candidates with a few products each: moving them to a GPU would cost more than the products);
    writes change the CPU index, whose GPU copy is made again for the next call.
    """
    if call not in CALLS:
        raise ValueError(f"call must be one of {', '.join(CALLS)}, got {call!r}")
    on_gpu = gpu and faiss_gpu_kind(kind, nbits)
    if call == "exact":
        return EXACT_CPU
    if call == "prescore":
        return CODES_CPU
    if call == "write":
        return FAISS_CPU
    if call == "range":
        if kind == "flat":
            return MATRIX_CPU
        return GPU_KNN_CPU_RANGE if on_gpu else FAISS_CPU
    return FAISS_GPU if on_gpu and k <= FAISS_GPU_MAX_K else FAISS_CPU
