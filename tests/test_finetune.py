"""The fine-tuned backbone: cut-point activations, the top trained on them, the cache key that follows the
weights, and a fine-tuned backbone's own graphs and features."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.report import selection_label
from fragsearch.model.backbone import Backbone
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import ImageConfig
from fragsearch.model.dataset import load_split_data
from fragsearch.model.features import config_key, config_payload
from fragsearch.model.graphs import preprocess, weights_digest
from fragsearch.model.image import RegionExtractor, region_crops
from fragsearch.model.parsers import make_parser
from fragsearch.model.places import Places
from fragsearch.training.cutpoint import CutStore, extract
from fragsearch.training.epochs import FragmentBatches, train_fragment_epoch
from fragsearch.training.finetune import CutFeatures, finetune, make_top, one_caption_each
from fragsearch.training.nets.backbone import Top, Trunk, efficientnet, onnx_graph
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.train import make_run, split_for_selection, train
from tests.conftest import exported
from tests.synthetic import make_dataset
from tests.test_backbone import picture

# crops through the float graph, 3 regions: a small, quick version of the served setting
CFG = ImageConfig(region_features="crop", backbone_precision="fp32", n_regions=3, min_box_frac=0.25,
                  proposal_resize=112, backbone_size=224)


def _save_weights(path: Path, bump: float = 0.0) -> Path:
    net = efficientnet()
    state = net.state_dict()
    state["_conv_head.weight"] = state["_conv_head.weight"] + bump
    torch.save(state, path)
    return path


def test_cache_key_follows_the_weights_not_their_path(tmp_path: Path) -> None:
    places = Places(tmp_path, tmp_path / "cache")  # a relative weights path is read against its artifacts
    imagenet = ImageConfig()
    assert "backbone_weights" not in json.dumps(config_payload(imagenet))  # the ImageNet keys are unchanged
    a = _save_weights(tmp_path / "a.pt")
    same = tmp_path / "elsewhere" / "b.pt"
    same.parent.mkdir()
    same.write_bytes(a.read_bytes())
    key_a = config_key(dataclasses.replace(imagenet, backbone_weights="a.pt"), places)  # relative to the artifacts
    assert key_a != config_key(imagenet, places)
    assert config_key(dataclasses.replace(imagenet, backbone_weights=str(same)), places) == key_a
    _save_weights(a, bump=1e-3)  # new bytes at the same path: a new key
    assert config_key(dataclasses.replace(imagenet, backbone_weights="a.pt"), places) != key_a
    assert weights_digest("") == ""
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        config_key(dataclasses.replace(imagenet, backbone_weights="missing.pt"), places)
    with pytest.raises(FileNotFoundError, match="a.pt"):  # the default places' artifacts hold no a.pt
        config_key(dataclasses.replace(imagenet, backbone_weights="a.pt"))


def test_trunk_and_top_compose_to_the_backbone() -> None:
    net = efficientnet()
    x = torch.from_numpy(np.stack([preprocess(picture(), 224)]))
    with torch.no_grad():
        whole = net.extract_features(x).mean(dim=(2, 3))  # type: ignore[operator]
        for cut in (14, 16):
            torch.testing.assert_close(Top(net, cut)(Trunk(net, cut)(x)), whole, atol=1e-4, rtol=1e-4)


def test_a_fine_tuned_backbone_has_its_own_graphs_and_features(tmp_path: Path) -> None:
    path = _save_weights(tmp_path / "ft.pt", bump=5e-2)
    graph = onnx_graph("fp32", tmp_path / "graphs", weights=str(path))
    assert weights_digest(str(path)) in graph.name and graph != onnx_graph("fp32", tmp_path / "graphs")
    x = preprocess(picture(), 224)[None]
    ft = Backbone("cpu", "fp32", "onnx", places=Places(cache=tmp_path), weights=str(path)).pooled(x)
    ref = Backbone("cpu", "fp32", "onnx", places=Places(cache=tmp_path)).pooled(x)
    assert not np.allclose(ft, ref, atol=1e-3)
    with pytest.raises(ValueError, match="crop"):
        RegionExtractor(dataclasses.replace(ImageConfig(), backbone_weights=str(path)))


def test_one_caption_each() -> None:
    pair = np.repeat(np.arange(4), 5)
    order = one_caption_each(pair, 1, np.random.default_rng(0))
    assert sorted(pair[order].tolist()) == [0, 1, 2, 3]
    assert sorted(pair[one_caption_each(pair, 2, np.random.default_rng(1))].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A coloured-shapes set, its crop features, its cut-point activations and a model trained on them."""
    root = tmp_path_factory.mktemp("finetune")
    make_dataset(root / "data", n_train=12, n_dev=4)
    cache = exported(root / "cache", CFG)  # the export step: the crops' graphs the extraction runs
    run = make_run("paper", {"epochs": 4, "dense_epochs": 2, "anneal_epochs": 1, "batch_size": 6, "h": 32,
                             "lr": 3e-3, "eval_every": 2, "selection": "val", "val_images": 3, "calibrate": 4})
    run.image = CFG
    data = load_split_data(root / "data", "train", CFG, cache, make_parser("spacy"))
    store = extract(root / "data", ["train"], CFG, cache, root / "acts", cut=16, progress=False)
    tr, val = split_for_selection(run.train, data)
    assert val is not None
    train(run, tr, val, root / "init", cache)
    return {"root": root, "cache": cache, "run": run, "data": data, "store": store, "tr": tr, "val": val}


def test_cut_point_store_is_complete_resumable_and_matches_the_served_features(tiny: dict[str, object]) -> None:
    store, data = tiny["store"], tiny["data"]
    assert isinstance(store, CutStore)
    assert store.done().all() and store.shape == (320, 7, 7) and store.n_fragments == 4
    again = extract(Path(str(tiny["root"])) / "data", ["train"], CFG, Path(str(tiny["cache"])), store.folder,
                    cut=16, progress=False)  # nothing left to do
    assert again.names == store.names
    with pytest.raises(ValueError, match="other settings"):
        CutStore.create(store.folder, store.names, 14, (192, 7, 7), 4)
    # the ImageNet top on the stored activations gives the cached (float) crop features
    _, top = make_top(16)
    feats = CutFeatures(store, list(data.names[:2]), top).pooled()  # type: ignore[attr-defined]
    np.testing.assert_allclose(feats, data.feats[:2], atol=0.05, rtol=0.02)  # type: ignore[attr-defined]
    with pytest.raises(KeyError):
        store.rows(["not-there.jpg"])


def test_the_top_trains_with_the_fragment_model_on_the_activations(tiny: dict[str, object]) -> None:
    run, tr, store = tiny["run"], tiny["tr"], tiny["store"]
    bundle = Checkpoint.load(Path(str(tiny["root"])) / "init" / "model.pt")
    net, top = make_top(16)
    before = [p.detach().clone() for p in top.parameters()]
    feats = CutFeatures(store, list(tr.names), top)  # type: ignore[attr-defined,arg-type]
    batches = FragmentBatches(bundle.text, tr, 0.0, "cpu")  # type: ignore[arg-type]
    opt = torch.optim.Adam(list(bundle.model.parameters()) + list(top.parameters()), lr=1e-3)
    rng = np.random.default_rng(0)
    loss = train_fragment_epoch(bundle.model, run.train, feats, tr, batches, opt, 3, rng,  # type: ignore[arg-type]
                                one_caption_each(tr.pair_image, 1, rng))  # type: ignore[attr-defined]
    assert np.isfinite(loss) and loss > 0
    moved = [not torch.equal(a, b) for a, b in zip(before, top.parameters(), strict=True)]
    assert all(moved)  # the head convolution and the batch norm's affine part
    assert torch.equal(net.state_dict()["_bn1.running_mean"], efficientnet().state_dict()["_bn1.running_mean"])


def test_finetune_keeps_the_best_epoch_on_the_validation_part(tiny: dict[str, object]) -> None:
    root = Path(str(tiny["root"]))
    bundle = Checkpoint.load(root / "init" / "model.pt")
    out = root / "ft"
    run = tiny["run"]
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, device="auto"))  # type: ignore[attr-defined]
    summary = finetune(bundle, run, tiny["tr"], tiny["val"], tiny["store"], out,  # type: ignore[arg-type]
                       Places(cache=Path(str(tiny["cache"]))), epochs=2, lr=1e-3, cnn_lr=1e-3, graphs=("fp32",))
    assert [row["epoch"] for row in summary["history"]] == [0, 1, 2]
    assert all(np.isfinite(row["loss"]) for row in summary["history"][1:])
    kept = Bundle.load(out / "model.pt")
    assert kept.meta["selection"]["epoch"] == summary["selection"]["epoch"]
    best = max(summary["history"], key=lambda r: r["val_rsum"])
    assert summary["best"]["rsum"] == best["val_rsum"]
    # the results table names the kept fine-tuning epoch (history.json is this summary and the run's names)
    assert selection_label(summary).endswith(f"fine-tuning epoch {summary['selection']['epoch']}/2 after the init run")
    weights = kept.image_cfg.backbone_weights
    assert Path(weights).is_file() and weights_digest(weights)
    # the served extractor: ImageNet ranking, the kept backbone's features for the crops
    cfg = dataclasses.replace(CFG, backbone_weights=weights)
    ext = RegionExtractor(cfg, places=Places(cache=Path(str(tiny["cache"]))))  # the graphs fine-tuning made
    img = picture()
    frag = ext.extract(img)
    ref = RegionExtractor(CFG).extract(img)
    np.testing.assert_array_equal(frag.boxes, ref.boxes)
    crops = region_crops(img, frag.boxes, 224)
    np.testing.assert_allclose(frag.features, ext.backbone.pooled(crops), atol=1e-5)
