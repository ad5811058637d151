"""The one device setting: ``auto`` | ``cpu`` | ``cuda`` (or ``cuda:N``), resolved once.

``auto`` is the GPU when torch sees one, else the CPU. ``cuda`` on a machine without a usable GPU
is a `DeviceError` (one clear line at start-up), never a silent fall-back: a service configured for
a GPU that runs on the CPU would be an order of magnitude slower without saying so.

Everything that computes takes the resolved device: checkpoints load on the CPU and move to it
(model/bundle.py), training and calibration put their batches on it, MiniLM and the image
backbone run on it. Where each call of a fragment index runs is `placement`, where image extraction
runs `extraction_device`: the one policy.
"""

from __future__ import annotations

import re

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# Where a call of a fragment index runs (`placement`).
FAISS_GPU = "faiss-gpu"  # the FAISS index's GPU copy, one call at a time (index/gpu.py)
FAISS_CPU = "faiss-cpu"  # the FAISS index in host memory
MATRIX_CPU = "matrix-cpu"  # NumPy products over the stored vectors of a flat FAISS index
GPU_KNN_CPU_RANGE = "faiss-gpu-knn+cpu-range"  # FAISS contrib's range search: k-NN on the GPU copy, a CPU
#                                                range search for the queries whose results fill the k-NN
MODEL_DEVICE = "model-device"  # torch on the model's device (CPU or CUDA): model/score.py through the Bundle
CODES_CPU = "codes-cpu"  # torch on the CPU, beside the prescore codes held in host memory (index.codes)
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


def extraction_device(device: str | torch.device, workers: int) -> str:
    """Where image extraction runs: a pool of worker processes (`workers` > 1) on the CPU whatever the
    device; one extractor in the calling process on `device`.

    Every process that touches CUDA opens a context of its own (hundreds of MB of GPU memory before its
    first tensor), and a pool starts one worker per usable CPU: on a many-core GPU host the workers
    alone would fill the GPU before the service starts. The served model's backbone is the int8 graph
    on ONNX Runtime's CPU provider in any case, so the workers lose nothing but the small proposal
    scoring and region layers, which run beside it on the CPU.
    """
    return "cpu" if workers > 1 else str(device)


def fused_optimizer(params: list[torch.nn.Parameter]) -> bool:
    """Training's optimizer step runs as torch's fused kernel: every parameter on the CPU or a GPU (5x
    faster than the per-tensor step for Adam on the CPU); elsewhere (the `meta` device of the tests)
    the per-tensor step."""
    return bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)


def host_masks(device: torch.device) -> bool:
    """Training's dropout masks are drawn with NumPy on the host for a tensor on the CPU (torch's CPU
    Bernoulli draw is ~2.5x slower); on any other device torch draws them where the tensor is."""
    return device.type == "cpu"


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
    for the queries whose k-NN are all positive), other kinds on the CPU. Exact scores run in torch on
    the model's device; the prescore on the CPU, where the codes are kept (moving thousands of
    candidates' codes to a GPU for a few products each costs more than the products); writes change
    the CPU index, whose GPU copy is made again for the next call.
    """
    if call not in CALLS:
        raise ValueError(f"call must be one of {', '.join(CALLS)}, got {call!r}")
    on_gpu = gpu and faiss_gpu_kind(kind, nbits)
    if call == "exact":
        return MODEL_DEVICE
    if call == "prescore":
        return CODES_CPU
    if call == "write":
        return FAISS_CPU
    if call == "range":
        if kind == "flat":
            return MATRIX_CPU
        return GPU_KNN_CPU_RANGE if on_gpu else FAISS_CPU
    return FAISS_GPU if on_gpu and k <= FAISS_GPU_MAX_K else FAISS_CPU
