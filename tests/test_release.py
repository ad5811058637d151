"""The released model (model/released/): its manifest, the check at every load, and the command that
writes a release (training/release.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from fragsearch.commands.release import main as release_main
from fragsearch.model.atomic import sha256_file
from fragsearch.model.bundle import Bundle, CheckpointError
from fragsearch.model.release import MANIFEST, RELEASE_DIR, RELEASED_MODEL, read_manifest, served_model_path
from fragsearch.training.release import manifest_of, teacher_of, write_release
from tests.conftest import ShapesModel


def ran(command: str, job: str) -> bool:
    """`command` runs the training job `job` (recorded as run: `python -m training.<job>` before the modules were
    fragsearch.training's, `python -m fragsearch.training.<job>` since)."""
    return re.match(rf"python -m (fragsearch\.)?training\.{job} ", command) is not None


def test_the_released_model_is_small_described_and_matches_its_manifest() -> None:
    manifest = read_manifest(RELEASE_DIR)
    listed = set(manifest["files"])
    assert listed == {p.name for p in RELEASE_DIR.iterdir() if p.name != MANIFEST}, "every file listed"
    for name, entry in manifest["files"].items():
        path = RELEASE_DIR / name
        assert path.stat().st_size == entry["bytes"] and sha256_file(path) == entry["sha256"], name
    assert sum(e["bytes"] for e in manifest["files"].values()) < 75 * 2**20  # 71.9 MB: weights, calibration, graphs
    features = manifest["features"]
    assert listed == {"model.json", "model.npz", features["graph"], "efficientnet-lite0-head.npz",
                      "minilm-l6-fp32-opset17-noweights.onnx"}, "the runtime's form and every graph it runs"
    assert manifest["files"]["minilm-l6-fp32-opset17-noweights.onnx"]["bytes"] < 2**20, "MiniLM's weights not copied"
    made = manifest["made_by"]
    assert ran(made["command"], "release") and len(made["commit"]) == 40
    assert ran(made["training_command"], "train") and "--selection val" in made["training_command"]
    training = manifest["training"]
    assert training["split"] == "train" and training["images"] > 5000 and len(training["images_sha256"]) == 64
    assert training["validation_part"]["rule"] == "val" and training["validation_part"]["images"] > 0
    assert features["precision"] == "int8" and features["quantization"]["reduce_range"] is True
    assert len(features["graph_sha256"]) == 64 and "avx2" in features["cpu"]["flags"]
    assert manifest["metrics"]["validation"]["rsum"] > 0 and manifest["metrics"]["dev"]["rsum"] > 0
    assert manifest["model"]["relevance"]["slope"] > 0, "a relevance scale: min_relevance works on the default"
    assert manifest["row"] == "full-2x256-distill-local", "the row of docs/results/rows.md the release is"
    rows = (RELEASE_DIR.parent.parent / "docs" / "results" / "flickr8k-dev.csv").read_text().splitlines()
    (row,) = [r.split(",") for r in rows if r.startswith(manifest["row"] + ",")]
    dev = manifest["metrics"]["dev"]
    assert [float(x) for x in row[1:3]] == [round(dev["annot_r1"], 1), round(dev["annot_r5"], 1)], \
        "the results table holds the release's dev numbers"
    assert ran(made["exported_from"]["command"], "release")  # made from a release
    teacher = made["teacher"]  # distilled: the teacher's checkpoint and the command that made it
    assert "--distill-from " + teacher["model"] in made["training_command"]
    assert ran(teacher["command"], "merge") and " --members " in teacher["command"]


def test_the_released_model_is_what_every_command_serves_by_default(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    from fragsearch.settings import default_model_path

    monkeypatch.chdir(tmp_path)  # no .env, no fragsearch.toml
    for name in ("FRAGSEARCH_MODEL_PATH", "FRAGSEARCH_VARIANT", "FRAGSEARCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FRAGSEARCH_ARTIFACTS", str(tmp_path))
    assert default_model_path() == RELEASED_MODEL
    monkeypatch.setenv("FRAGSEARCH_VARIANT", "paper")
    assert default_model_path() == tmp_path / "models" / "paper" / "model.pt"
    monkeypatch.setenv("FRAGSEARCH_MODEL_PATH", str(tmp_path / "mine.pt"))
    assert default_model_path() == tmp_path / "mine.pt"
    assert served_model_path(tmp_path) == RELEASED_MODEL


def test_a_changed_or_truncated_release_file_is_refused_with_its_name(tmp_path: Path) -> None:
    copy = tmp_path / "released"
    shutil.copytree(RELEASE_DIR, copy)
    bundle = Bundle.load(copy)  # a whole copy loads
    assert bundle.relevance is not None and bundle.calibration is not None
    data = bytearray((copy / "model.npz").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed, the size kept
    (copy / "model.npz").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.npz: sha256 .* release manifest"):
        Bundle.load(copy)
    (copy / "model.npz").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match=r"model\.npz: \d+ bytes where the release manifest records"):
        Bundle.load(copy / "model.json")
    (copy / "model.npz").unlink()
    with pytest.raises(CheckpointError, match=r"model\.npz: missing from the release"):
        Bundle.load(copy)
    (copy / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a readable release manifest"):
        Bundle.load(copy)


def test_the_release_command_writes_a_manifest_that_every_load_checks(shapes_model: ShapesModel,
                                                                      tmp_path: Path) -> None:
    bundle = shapes_model.bundle
    dev = {"rsum": 123.456, "annot_r1": 1.0}
    manifest = manifest_of(bundle, shapes_model.model_path, shapes_model.data, dev,
                           "python -m fragsearch.training.release x")
    assert manifest["row"] == shapes_model.model_path.parent.name  # the model folder's name, unless --row
    assert manifest_of(bundle, shapes_model.model_path, shapes_model.data, dev, "x", override="mine")["row"] == "mine"
    release = tmp_path / "release"
    (release).mkdir()
    (release / "model.pt").write_bytes(b"an earlier release's file")
    out = write_release(bundle, release, manifest)
    written = json.loads((release / MANIFEST).read_text())
    assert written == out and written["files"]["model.npz"]["sha256"] == sha256_file(release / "model.npz")
    assert set(written["files"]) == {p.name for p in release.iterdir()} - {MANIFEST}, "every file listed"
    assert not (release / "model.pt").exists(), "what the release no longer ships is removed"
    assert {"model.json", "model.npz", "efficientnet-lite0-head.npz", "minilm-l6-fp32-opset17-noweights.onnx",
            "efficientnet-lite0-fp32-opset17.onnx"} == set(written["files"]), "the shapes model's float graph"
    assert written["metrics"]["dev"] == {"rsum": 123.46, "annot_r1": 1.0}
    assert written["training"]["images"] == 60  # the shapes collection's training images
    assert written["row"] == shapes_model.model_path.parent.name and "teacher" not in written["made_by"]
    again = Bundle.load(release)
    assert again.cfg == bundle.cfg and "exported_from" not in written["made_by"]
    (release / "model.npz").write_bytes(b"x" * written["files"]["model.npz"]["bytes"])
    with pytest.raises(CheckpointError, match="release manifest"):
        Bundle.load(release)


def test_a_distilled_models_manifest_names_its_teacher(tmp_path: Path) -> None:
    """`teacher` comes from the members' training configs, and the teacher's command from its folder."""
    model = tmp_path / "student" / "model.pt"
    for k in (1, 2):
        (model.parent / f"member-{k}").mkdir(parents=True)
        (model.parent / f"member-{k}" / "history.json").write_text(json.dumps(
            {"config": {"train": {"distill_from": str(tmp_path / "teacher" / "model.pt")}}}))
    assert teacher_of(model) == {"teacher": {"model": str(tmp_path / "teacher" / "model.pt")}}
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "history.json").write_text(json.dumps({"command": "python -m fragsearch.training.merge x"}))
    assert teacher_of(model)["teacher"]["command"] == "python -m fragsearch.training.merge x"
    (model.parent / "member-2" / "history.json").write_text(json.dumps({"config": {"train": {"distill_from": None}}}))
    assert teacher_of(model)["teacher"]["model"] == str(tmp_path / "teacher" / "model.pt")
    other = tmp_path / "other" / "model.pt"
    for k in (1, 2):
        (model.parent / f"member-{k}" / "history.json").write_text(json.dumps(
            {"config": {"train": {"distill_from": f"{tmp_path / 'teacher' / 'model.pt'},{other}"}}}))
    assert teacher_of(model) == {"teacher": {"model": [str(tmp_path / "teacher" / "model.pt"), str(other)],
                                             "command": ["python -m fragsearch.training.merge x", None]}}
    for k in (1, 2):
        (model.parent / f"member-{k}" / "history.json").write_text(json.dumps({"config": {"train": {}}}))
    assert teacher_of(model) == {}, "a model trained alone names no teacher"


def test_the_release_command_refuses_a_model_without_a_relevance_scale(shapes_model: ShapesModel,
                                                                      tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert shapes_model.bundle.relevance is None  # trained with the last epoch kept: no validation part
    with pytest.raises(SystemExit) as exc:
        release_main(["--model", str(shapes_model.model_path), "--out", str(tmp_path / "r"),
                      "--data", str(shapes_model.data), "--cache", str(shapes_model.cache)])
    assert exc.value.code == 2 and "--selection val" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_new_released_model_is_a_new_version() -> None:
    """service/version.py names the weights the version ships: a release without a new version fails here."""
    from fragsearch.model.release import read_manifest
    from fragsearch.service.version import RELEASED_MODEL

    assert read_manifest()["files"]["model.npz"]["sha256"] == RELEASED_MODEL, \
        "model/released/ changed: set a new __version__ and RELEASED_MODEL in service/version.py (and CHANGELOG.md)"


def test_a_model_whose_proposals_a_region_ranker_orders_ships_its_file(shapes_model: ShapesModel,
                                                                       tmp_path: Path) -> None:
    import copy
    import dataclasses

    from fragsearch.model.places import Places
    from fragsearch.training.graphs import make_graphs
    from tests.test_regions import small_first

    bundle = copy.copy(shapes_model.bundle)
    bundle.places = Places(tmp_path, tmp_path / "cache")  # where the release command looks for the ranker
    nowhere = "region-ranker-000000000000.npz"  # a name no ranker's content has
    bundle.image_cfg = dataclasses.replace(bundle.image_cfg, region_ranker=nowhere)
    make_graphs(bundle.image_cfg, bundle.places, [None], head=True)  # the release's export step (the command's)
    manifest = manifest_of(bundle, shapes_model.model_path, shapes_model.data, {"rsum": 1.0}, "x")
    with pytest.raises(FileNotFoundError, match=nowhere):
        write_release(bundle, tmp_path / "missing", manifest)
    ranker = small_first(seed=7)
    ranker.save(bundle.places.graphs)
    bundle.image_cfg = dataclasses.replace(bundle.image_cfg, region_ranker=ranker.name())
    written = write_release(bundle, tmp_path / "release", manifest_of(
        bundle, shapes_model.model_path, shapes_model.data, {"rsum": 1.0}, "x"))
    assert ranker.name() in written["files"], "the ranker's file travels with the model that names it"
    assert written["features"]["region_ranker"] == ranker.name()
    assert Bundle.load(tmp_path / "release").image_cfg.region_ranker == ranker.name()
