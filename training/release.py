"""Write the released model: a trained checkpoint exported into model/released/ in the runtime's form, with the
graphs it runs and its manifest.

    python -m fragsearch.training.release --model artifacts/models/release-full-2x256/model.pt

The one way a release is made (model/release.py reads and checks it). The checkpoint must carry a
relevance scale (a model trained with --selection val: the scale is fitted on its validation part)
and its validation metrics; the command evaluates it once on dev through the served path (the runtime's
NumPy encoders and S_kl, the graphs it ships) and writes the release folder:

- model.json and model.npz: the model in the runtime's form (model/bundle.py; NumPy reads it, no torch);
- the image backbone's graph for the model's precision (the int8 graph) and its ImageNet head's arrays, and
  MiniLM's graph without its weights (they are read from MiniLM's package at load): everything the service
  runs but the parser and MiniLM's weights, which come from their pinned packages;
- manifest.json:
  - `name` (the variant: the recipe) and `row` (the model folder's name: its row in docs/results);
  - `made_by`: this command line, the commit (and whether the work tree had changes), the date, and
    the training command from the model folder's history.json; for a distilled model `teacher`: the
    teacher's checkpoint and the command that made it (from its folder's history.json; a teacher of several
    checkpoints: the lists of both). A model released before (`--model` inside a release folder) keeps its
    recorded training provenance, and `made_by.exported_from` names the release it came from;
  - `training`: the split it was trained on, as digests (sha256 over every image's name and content,
    and over its captions), and the validation part held out of it;
  - `features`: the backbone, its precision and quantisation recipe, the int8 graph's sha256, the
    ONNX Runtime version, and the CPU the features were extracted on (model name and SIMD flags);
  - `metrics`: validation (from the checkpoint) and dev (measured here);
  - `files`: size and sha256 of every file in the folder, checked at every load.

Its command line: fragsearch/commands/release.py (`python -m fragsearch.training.release` calls it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

from fragsearch.model.atomic import atomic_path, sha256_file
from fragsearch.model.backbone import backbone_graph
from fragsearch.model.bundle import MODEL_ARRAYS, MODEL_JSON, Bundle
from fragsearch.model.data import load_split
from fragsearch.model.graphs import quant_recipe
from fragsearch.model.image import extractor_files
from fragsearch.model.minilm import minilm_graph
from fragsearch.model.release import MANIFEST, MANIFEST_FORMAT, ReleaseError, is_released, read_manifest
from fragsearch.model.resources import cpu_record
from fragsearch.training.distill import teacher_paths

logger = logging.getLogger(__name__)

REPORTED = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10", "annot_medr",
            "search_medr")
ROOT = Path(__file__).resolve().parent.parent


def split_digests(data: Path, split: str) -> dict[str, Any]:
    """sha256 over the split's image names and contents (name + the file's sha256, one line each, in list
    order) and over its captions (name + caption lines): what the model saw, without the data itself."""
    sp = load_split(data, split)
    images, captions = hashlib.sha256(), hashlib.sha256()
    for name, caps in zip(sp.images, sp.captions, strict=True):
        images.update(f"{name}\t{sha256_file(sp.image_path(name))}\n".encode())
        for c in caps:
            captions.update(f"{name}\t{c}\n".encode())
    return {"split": split, "images": len(sp.images), "captions": sum(len(c) for c in sp.captions),
            "images_sha256": images.hexdigest(), "captions_sha256": captions.hexdigest()}


def git_commit(checkout: Path = ROOT) -> dict[str, Any]:
    """The commit a checkout is at and whether its tracked files had changes then."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def rounded(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: round(float(metrics[k]), 2) for k in REPORTED if k in metrics}


def teacher_of(model: Path) -> dict[str, Any]:
    """{"teacher": {"model", "command"}} when the members of `model` were distilled from a teacher
    (their history.json's config names it), else {}."""
    teachers = {str(train["distill_from"]) for h in sorted(model.parent.glob("member-*/history.json"))
                if (train := json.loads(h.read_text()).get("config", {}).get("train", {})).get("distill_from")}
    if not teachers:
        return {}
    if len(teachers) > 1:
        return {"teacher": {"model": sorted(teachers)}}
    parts = [str(p) for p in teacher_paths(teachers.pop())]
    commands = [json.loads(h.read_text()).get("command") if (h := Path(p).parent / "history.json").is_file()
                else None for p in parts]
    if len(parts) == 1:
        return {"teacher": {"model": parts[0], **({"command": commands[0]} if commands[0] else {})}}
    return {"teacher": {"model": parts, "command": commands}}


def released_before(model: Path) -> dict[str, Any] | None:
    """The manifest of the release `model` is a file of (a model released before, exported again), else None."""
    if not is_released(model):
        return None
    try:
        return read_manifest(model.parent)
    except ReleaseError:
        return None


def manifest_of(bundle: Bundle, model: Path, data: Path, dev: dict[str, float], command: str,
                before: dict[str, Any] | None = None, override: str | None = None) -> dict[str, Any]:
    """Everything but `files` (added once the folder is written); `before`: the manifest of the release this
    one replaces (default: the one `model` is a file of), whose training provenance it keeps; `override`:
    the results row it is (default: the model folder's name, or `before`'s)."""
    history = model.parent / "history.json"
    trained = json.loads(history.read_text()) if history.is_file() else {}
    selection = dict(bundle.meta.get("selection", {}))
    import onnxruntime

    cfg = bundle.image_cfg
    features: dict[str, Any] = {"backbone": cfg.backbone, "precision": cfg.backbone_precision,
                                "region_features": cfg.region_features, "regions": cfg.n_regions,
                                "onnxruntime": onnxruntime.__version__, "cpu": cpu_record()}
    if cfg.region_ranker:
        features.update(region_ranker=cfg.region_ranker, min_box_frac=cfg.min_box_frac)
        if cfg.head_regions:
            features.update(head_regions=cfg.head_regions, head_min_box_frac=cfg.head_min_box_frac)
    if cfg.backbone_precision == "int8":
        graph = backbone_graph("int8", cfg.backbone, cfg.backbone_weights, bundle.places)
        features.update(quantization=quant_recipe(), graph=graph.name, graph_sha256=sha256_file(graph))
    rel = bundle.relevance
    made_by: dict[str, Any] = {"command": command, **git_commit(),
                               "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                               "training_command": trained.get("command"),
                               "member_epochs": trained.get("member_epochs"), **teacher_of(model)}
    before = before if before is not None else released_before(model)
    name, row = str(bundle.meta.get("variant") or model.parent.name), model.parent.name
    training = {**split_digests(data, "train"),
                "validation_part": {k: selection[k] for k in ("rule", "images", "seed") if k in selection}}
    if before is not None:  # a release exported again: its training provenance stays what it recorded
        was = before.get("made_by", {})
        made_by.update({k: was[k] for k in ("training_command", "member_epochs", "teacher") if k in was},
                       exported_from={k: was.get(k) for k in ("command", "commit", "date")})
        name, row = before.get("name", name), before.get("row", row)
        training = {**training, "validation_part": before.get("training", {}).get("validation_part",
                                                                                training["validation_part"])}
    return {
        "format": MANIFEST_FORMAT,
        "name": name,
        "row": override or row,
        "made_by": made_by,
        "model": {"h": bundle.dim, "blocks": bundle.blocks, "words": len(bundle.text.words.words),
                  "relevance": None if rel is None else rel.to_state(),
                  "grounder": None if bundle.grounder is None else bundle.grounder.summary(),
                  "presence": None if bundle.presence is None else bundle.presence.summary()},
        "training": training,
        "features": features,
        "metrics": {"validation": rounded(selection.get("val", {})), "dev": rounded(dev)},
    }


def runtime_files(bundle: Bundle) -> list[Path]:
    """The graphs a model runs, in the release folder or the bundle's graph folder (`Bundle.places`; the release's
    export step, `make_graphs`, made them there first): what its extractor reads (model/image.py
    `extractor_files`: the proposal ranker's and the features' backbone graphs at its precision, the ImageNet
    head's arrays or the region ranker's where it ranks proposals with them) and MiniLM's graph (a model with its
    own top layers of MiniLM runs that graph with them: the layers themselves are the model's weights)."""
    return [*extractor_files(bundle.image_cfg, bundle.places), minilm_graph(bundle.places.graphs)]


def write_release(bundle: Bundle, out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Export the model into `out` in the runtime's form, copy the graphs it runs beside it, and write the
    manifest with every file's size and sha256 (each write atomic: a crash leaves the previous release whole,
    or new files beside the old manifest, which then refuses them by name). Files of an earlier release that
    this one does not ship are removed once the manifest is written."""
    out.mkdir(parents=True, exist_ok=True)
    graphs = runtime_files(bundle)
    bundle.save(out)
    for src in graphs:
        if src.resolve() != (out / src.name).resolve():
            with atomic_path(out / src.name) as tmp:
                shutil.copyfile(src, tmp)
    names = [MODEL_JSON, MODEL_ARRAYS, *(g.name for g in graphs)]
    files = {n: {"bytes": (out / n).stat().st_size, "sha256": sha256_file(out / n)} for n in names}
    manifest = {**manifest, "files": files}
    with atomic_path(out / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    read_manifest(out)  # what was written reads back as a release
    for old in out.iterdir():
        if old.is_file() and old.name not in files and old.name != MANIFEST:
            old.unlink()
    return manifest


if __name__ == "__main__":  # `python -m fragsearch.training.release`, as the docs write it: the command's alias
    from fragsearch.commands.release import main

    main()
