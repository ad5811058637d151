"""Variants as data (model/variants/*.toml): each resolves to the settings the rows of the results
table were trained with, the files are checked, documented and listed, and serving imports no
training code to learn what a variant is."""

from __future__ import annotations

import dataclasses
import io
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from fragsearch.commands.extract import main as extract
from fragsearch.model.config import ImageConfig, TextConfig, TrainConfig
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.variants import (
    FIELD_TYPES,
    VARIANTS_DIR,
    VariantError,
    load_variant,
    read_variant_file,
    variant_names,
)
from fragsearch.training.train import list_resolved, list_variants, make_run
from tests.conftest import ShapesModel

ROOT = Path(__file__).resolve().parent.parent

# Every row's settings as the trainer's dict chain gave them, written out flat (section -> field -> value).
LR = {"text": {"sentence_fragment": True}, "image": {"min_box_frac": 0.15}, "train": {"global_top_k": 5}}
CTX = {"text": {"sentence_fragment": True, "word_vectors": "contextual"}}
ROI = {"model": {"h": 512, "input_dropout": 0.2}, **CTX, "image": {"min_box_frac": 0.25},
       "train": {"global_top_k": 5, "beta": 2.0, "calibrate": 1000}}
EXPECTED: dict[str, dict[str, dict[str, Any]]] = {
    "paper": {},
    "fragment+global": {"train": {"objective": "fragment+global"}},
    "fragment": {"train": {"objective": "fragment"}},
    "global": {"train": {"objective": "global"}},
    "fullframe": {"image": {"full_frame_only": True}},
    "bow": {"text": {"fragments": "bow"}},
    "bigram": {"text": {"fragments": "bigram"}},
    "sentence": {"text": {"sentence_fragment": True}},
    "two-branch": {"model": {"kind": "two-branch", "h": 512}, "text": {"sentence_fragment": True},
                   "image": {"min_box_frac": 0.25},
                   "train": {"lr": 1e-3, "weight_decay": 1e-5, "epochs": 30, "batch_size": 128, "eval_every": 3}},
    "large-regions": LR,
    "large-regions+mlp": {**LR, "model": {"image_hidden": 1024}},
    "contextual": {**LR, **CTX},
    "contextual-r25": {**CTX, "image": {"min_box_frac": 0.25}, "train": {"global_top_k": 5}},
    "wide": {"model": {"h": 512}, **CTX, "image": {"min_box_frac": 0.25}, "train": {"global_top_k": 5, "beta": 2.0}},
    "dropout": {"model": {"h": 512, "input_dropout": 0.2}, **CTX, "image": {"min_box_frac": 0.25},
                "train": {"global_top_k": 5, "beta": 2.0}},
    "full-roi": ROI,
    "full-crop": {**ROI, "image": {"min_box_frac": 0.25, "region_features": "crop"}},
    "full": {**ROI, "image": {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8",
                              "proposal_resize": 112, "backbone_size": 224}},
}
# the recipe rows: full with one training setting changed each
EXPECTED |= {
    "full-maxviol": {**EXPECTED["full"], "train": {**ROI["train"], "max_violation_from": 5}},
    "full-fragdrop": {**EXPECTED["full"], "train": {**ROI["train"], "fragment_drop": 0.2}},
    "full-long": {**EXPECTED["full"], "train": {**ROI["train"], "epochs": 20, "dense_epochs": 10, "anneal_epochs": 2}},
    "full-mirror": {**EXPECTED["full"], "train": {**ROI["train"], "mirror_views": 0.5}},
    "full-nce": {**EXPECTED["full"], "train": {**ROI["train"], "nce_scale": 20.0}},
    "full-mlp": {**EXPECTED["full"], "model": {**ROI["model"], "image_hidden": 1024}},
    "full-pool": {**EXPECTED["full"], "model": {**ROI["model"], "pool_ranks": 20}},
    **{f"full-text{n}": {**EXPECTED["full"], "model": {**ROI["model"], "text_layers": n}} for n in (1, 2, 6)},
    "full-global-mlp": {**EXPECTED["full"], "model": {**ROI["model"], "global_hidden": 1024}},
    "full-2x256": {**EXPECTED["full"], "model": {**ROI["model"], "h": 256}, "train": {**ROI["train"], "members": 2}},
}
# the backbone rows: full's crops through EfficientNet-Lite1 / Lite2 at their native sides
EXPECTED["full-lite1"] = {**EXPECTED["full"], "image": {**EXPECTED["full"]["image"], "backbone": "efficientnet-lite1",
                                                        "crop_size": 240}}
EXPECTED["full-lite1-2x256"] = {**EXPECTED["full-2x256"], "image": EXPECTED["full-lite1"]["image"]}
EXPECTED["full-lite2"] = {**EXPECTED["full"], "image": {**EXPECTED["full"]["image"], "backbone": "efficientnet-lite2",
                                                        "crop_size": 260}}
# regions from the COCO detector: its 19 best boxes, or its confident ones topped up by selective search
# full-2x256 with the training captions' phrase boxes (Flickr30k Entities) labelling their triplets' regions
EXPECTED["full-2x256-boxes"] = {**EXPECTED["full-2x256"],
                                "train": {**EXPECTED["full-2x256"]["train"], "box_supervision": True}}
EXPECTED["full-det-2x256"] = {**EXPECTED["full-2x256"], "image": {**EXPECTED["full"]["image"], "proposals": "detector"}}
EXPECTED["full-dettop-2x256"] = {**EXPECTED["full-2x256"], "image": {**EXPECTED["full"]["image"],
                                                                     "proposals": "detector_topup",
                                                                     "detector_floor": 0.3}}
EXPECTED["full-detcls-2x256"] = {**EXPECTED["full-dettop-2x256"], "image": {**EXPECTED["full-dettop-2x256"]["image"],
                                                                     "detector_classes": True}}
EXPECTED["full-detcls-lite1-2x256"] = {**EXPECTED["full-detcls-2x256"], "image": {
    **EXPECTED["full-detcls-2x256"]["image"], "backbone": "efficientnet-lite1", "crop_size": 240}}
# the global baselines over the served model's whole-image feature
CROP = {"min_box_frac": 0.25, "region_features": "crop", "backbone_precision": "int8", "proposal_resize": 112,
        "backbone_size": 224}
RNN = {"model": {"kind": "dt-rnn", "h": 256}, "text": {"fragments": "tree"}, "image": CROP, "train": {"margin": 1.0}}
DEVISE = {"model": {"kind": "devise", "h": 384}, "text": {"fragments": "tree"}, "image": CROP,
          "train": {"margin": 0.1, "rank_images": False}}
EXPECTED |= {
    "dt-rnn": RNN,
    "sdt-rnn": {**RNN, "model": {"kind": "sdt-rnn", "h": 256}},
    "devise": DEVISE,
    "devise-bidirectional": {**DEVISE, "train": {"margin": 0.1}},
    "dt-rnn-contextual": {**RNN, "text": {"fragments": "tree", "word_vectors": "contextual"}},
    "sdt-rnn-contextual": {**RNN, "model": {"kind": "sdt-rnn", "h": 256},
                           "text": {"fragments": "tree", "word_vectors": "contextual"},
                           "train": {"margin": 1.0, "grad_clip": 5.0}},
    "devise-contextual": {**DEVISE, "text": {"fragments": "tree", "word_vectors": "contextual"}},
}


def test_every_variant_is_a_file_and_every_file_a_known_row() -> None:
    assert variant_names() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_variant_resolves_to_the_rows_settings(name: str) -> None:
    want = EXPECTED[name]
    model = want.get("model", {})
    v = load_variant(name)
    assert v.text == TextConfig(**want.get("text", {}))
    assert v.image == ImageConfig(**want.get("image", {}))
    assert v.train == TrainConfig(**{**want.get("train", {}), "h": model.get("h", 256)})
    assert v.model == model and v.model_kind == model.get("kind", "fragment")
    run = make_run(name, {})
    assert (run.train, run.text, run.image, run.model_kind, run.model_overrides) == (
        v.train, v.text, v.image, v.model_kind, v.model)


def test_full_roi_and_two_branch_field_by_field() -> None:
    defaults_train = {"objective": "full", "epochs": 10, "dense_epochs": 4, "anneal_epochs": 2, "batch_size": 100,
                      "optimizer": "adam", "lr": 0.001, "text_lr": 2e-5, "text_from": "", "momentum": 0.9,
                      "weight_decay": 1e-6,
                      "grad_clip": 0.0,
                      "beta": 1.0, "margin": 0.05, "global_top_k": 0, "max_violation_from": 0, "fragment_drop": 0.0,
                      "box_supervision": False, "nce_scale": 0.0, "mirror_views": 0.0,
                      "distill_from": "", "distill_weight": 1.0, "distill_scale": 3.0,
                      "rank_images": True, "balanced": True, "h": 256,
                      "calibrate": 0,
                      "tb_margin": 0.1, "tb_top_k": 50, "tb_lambda_img": 2.0, "tb_lambda_struct": 0.1,
                      "selection": "val", "val_images": 500, "val_seed": 0, "eval_every": 2, "seed": 0,
                      "members": 1, "device": "auto"}
    defaults_text = {"parser": "spacy", "fragments": "dependency", "relation_cutoff": 0.01, "min_word_count": 1,
                     "sentence_fragment": False, "word_vectors": "static", "unigram_prob": 0.05, "max_words": 64,
                     "sentence_pass": "text"}
    defaults_image = {"n_regions": 19, "region_features": "roi_align", "backbone_size": 448, "crop_size": 224,
                      "backbone_precision": "fp32", "proposal_mode": "balanced", "proposal_resize": 224,
                      "max_proposals": 300, "min_box_frac": 0.04, "nms_iou": 0.5, "full_frame_only": False,
                      "backbone_weights": "", "backbone": "efficientnet-lite0", "mirror": False,
                      "proposals": "selective_search", "detector_floor": 0.3, "detector_classes": False,
                      "decode_side": 1024, "region_ranker": "",
                      "head_regions": 0, "head_min_box_frac": 0.25}
    full = load_variant("full")
    assert dataclasses.asdict(full.train) == {**defaults_train, "h": 512, "global_top_k": 5, "beta": 2.0,
                                              "calibrate": 1000}
    assert dataclasses.asdict(full.text) == {**defaults_text, "sentence_fragment": True,
                                             "word_vectors": "contextual"}
    assert dataclasses.asdict(full.image) == {**defaults_image, "region_features": "crop", "backbone_size": 224,
                                              "backbone_precision": "int8", "proposal_resize": 112,
                                              "min_box_frac": 0.25}
    assert full.model == {"h": 512, "input_dropout": 0.2}
    roi = load_variant("full-roi")
    assert dataclasses.asdict(roi.train) == dataclasses.asdict(full.train)
    assert dataclasses.asdict(roi.image) == {**defaults_image, "min_box_frac": 0.25}
    tb = load_variant("two-branch")
    assert dataclasses.asdict(tb.train) == {**defaults_train, "h": 512, "lr": 0.001, "weight_decay": 1e-5,
                                            "epochs": 30, "batch_size": 128, "eval_every": 3}
    assert dataclasses.asdict(tb.text) == {**defaults_text, "sentence_fragment": True}
    assert dataclasses.asdict(tb.image) == {**defaults_image, "min_box_frac": 0.25}
    assert tb.model == {"kind": "two-branch", "h": 512} and tb.model_kind == "two-branch"


def test_flags_override_the_variant() -> None:
    run = make_run("full", {"h": 128, "epochs": 3}, {"input_dropout": 0.0})
    assert (run.train.h, run.train.epochs, run.train.beta, run.model_overrides["input_dropout"]) == (128, 3, 2.0, 0.0)


def test_base_chain_field_by_field_and_malformed_files(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('[train]\nbeta = 2\nepochs = 3\n[model]\nh = 64\n')
    (tmp_path / "b.toml").write_text('base = "a"\ndescription = "b"\n[train]\nepochs = 5\n')
    b = load_variant("b", tmp_path)
    assert (b.train.beta, b.train.epochs, b.train.h, b.base, b.description) == (2.0, 5, 64, "a", "b")
    assert isinstance(b.train.beta, float)
    (tmp_path / "c.toml").write_text('base = "d"\n')
    (tmp_path / "d.toml").write_text('base = "c"\n')
    with pytest.raises(VariantError, match="base cycle"):
        load_variant("c", tmp_path)
    (tmp_path / "e.toml").write_text('base = "nope"\n')
    with pytest.raises(VariantError, match="unknown variant 'nope' \\(the base of 'e'\\)"):
        load_variant("e", tmp_path)
    (tmp_path / "f.toml").write_text("[train]\nbetta = 1.0\n")
    with pytest.raises(VariantError, match="no field 'betta'"):
        load_variant("f", tmp_path)
    (tmp_path / "g.toml").write_text('[train]\nepochs = "ten"\n')
    with pytest.raises(VariantError, match="is not of type int"):
        load_variant("g", tmp_path)
    (tmp_path / "h.toml").write_text("[image]\nn_regions = true\n")
    with pytest.raises(VariantError, match="is not of type int"):
        load_variant("h", tmp_path)
    (tmp_path / "i.toml").write_text('[optim]\nlr = 1.0\n')
    with pytest.raises(VariantError, match="unknown keys"):
        load_variant("i", tmp_path)
    with pytest.raises(VariantError, match="unknown variant 'zz'"):
        load_variant("zz", tmp_path)


def test_every_variant_reads_in_its_file_and_at_most_one_base() -> None:
    """No variant extends one that extends another (at most one `base` between a variant and the defaults),
    and the served full reads whole in its own file."""
    extends = {name: read_variant_file(VARIANTS_DIR / f"{name}.toml")[0] for name in variant_names()}
    deeper = {name: f"{base} -> {extends[base]}" for name, base in extends.items()
              if base is not None and extends[base] is not None}
    assert deeper == {}, deeper
    assert extends["full"] is None and extends["full-crop"] is None and extends["full-maxviol"] == "full"


def test_a_base_that_extends_another_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text("[train]\nbeta = 2.0\n")
    (tmp_path / "b.toml").write_text('base = "a"\n[train]\nepochs = 3\n')
    (tmp_path / "c.toml").write_text('base = "b"\n[train]\nepochs = 5\n')
    assert load_variant("b", tmp_path).train.beta == 2.0
    with pytest.raises(VariantError, match="its base 'b' extends 'a'"):
        load_variant("c", tmp_path)


def test_every_field_is_documented() -> None:
    """model/variants/README.md has one table row per field a variant may set, under its section."""
    text = (VARIANTS_DIR / "README.md").read_text()
    for section, types in FIELD_TYPES.items():
        body = text.split(f"## `[{section}]`", 1)[1].split("\n## ", 1)[0]
        rows = re.findall(r"^\| `(\w+)` \| (\w+) \| [^|]+ \| \S[^|]* \|$", body, flags=re.M)
        assert {name: kind for name, kind in rows} == {k: t.__name__ for k, t in types.items()}, section


def test_list_names_every_variant_with_its_base_and_description() -> None:
    out = io.StringIO()
    list_variants(out)
    lines = out.getvalue().splitlines()
    assert [ln.split()[0] for ln in lines[::2]] == variant_names()
    full = lines[2 * variant_names().index("full")]
    assert "= defaults + " in full and "image.backbone_precision=int8" in full
    assert load_variant("full").description in lines[2 * variant_names().index("full") + 1]


def test_list_resolved_prints_every_field_of_every_variant_as_toml() -> None:
    out = io.StringIO()
    list_resolved(out, variant_names())
    printed = tomllib.loads(out.getvalue())
    assert sorted(printed) == variant_names()
    for name in variant_names():
        v = load_variant(name)
        assert (printed[name]["text"], printed[name]["image"], printed[name]["train"]) == (
            dataclasses.asdict(v.text), dataclasses.asdict(v.image), dataclasses.asdict(v.train)), name
        assert printed[name]["model"] == {**printed[name]["model"], **v.model, "kind": v.model_kind}, name
        assert (printed[name]["description"], printed[name].get("base")) == (v.description, v.base), name
    assert printed["paper"]["model"] == {"kind": "fragment", "h": 256, "image_hidden": 0, "global_hidden": 0,
                                         "dropout": 0.5, "input_dropout": 0.0, "pool_ranks": 0,
                                         "text_layers": 0}
    assert printed["full"]["model"]["input_dropout"] == 0.2 and printed["full"]["image"]["backbone_precision"] == "int8"
    assert printed["fragment+global"]["train"]["objective"] == "fragment+global"


def test_serving_does_not_import_the_trainer() -> None:
    code = ("import sys, service.app, service.prepare, bench.report; "
            "sys.exit(1 if 'fragsearch.training.train' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_extract_reads_a_variants_image_settings_and_its_flags_override_them(
        shapes_model: ShapesModel, tmp_path: Path) -> None:
    """`training.extract --variant NAME` fills the cache a run of that variant reads (its image settings,
    a region flag on top); an unknown variant is a usage error before anything is extracted."""
    split = load_split(shapes_model.data, "train").subset(2)
    images = [split.image_path(n) for n in split.images]
    extract(["--data", str(shapes_model.data), "--cache", str(tmp_path), "--splits", "train", "--limit", "2",
             "--workers", "1", "--variant", "paper", "--min-box-frac", "0.3"])
    want = feature_cache(tmp_path, dataclasses.replace(load_variant("paper").image, min_box_frac=0.3))
    assert all(want.has(p) for p in images)
    assert [d.name for d in (tmp_path / "features").iterdir()] == [want.dir.name], "one cache, the variant's"
    with pytest.raises(SystemExit):
        extract(["--data", str(shapes_model.data), "--cache", str(tmp_path / "none"), "--variant", "no-such"])
    assert not (tmp_path / "none").exists()
