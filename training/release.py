"""Write the released model: a trained checkpoint saved into model/released/ with its manifest.

    python -m training.release --model artifacts/models/release-full-2x256/model.pt

The one way a release is made (model/release.py reads and checks it). The checkpoint must carry a
relevance scale (a model trained with --selection val: the scale is fitted on its validation part)
and its validation metrics; the command evaluates it once on dev through the served feature path
(the int8 graph of model/backbone.py) and writes manifest.json beside the saved checkpoint:

- `name` (the variant: the recipe) and `row` (the model folder's name: its row in docs/results);
- `made_by`: this command line, the commit (and whether the work tree had changes), the date, and
  the training command from the model folder's history.json; for a distilled model `teacher`: the
  teacher's checkpoint and the command that made it (from its folder's history.json; a teacher of several
  checkpoints: the lists of both);
- `training`: the split it was trained on, as digests (sha256 over every image's name and content,
  and over its captions), and the validation part held out of it;
- `features`: the backbone, its precision and quantisation recipe, the int8 graph's sha256, the
  ONNX Runtime version, and the CPU the features were extracted on (model name and SIMD flags);
- `metrics`: validation (from the checkpoint) and dev (measured here);
- `files`: size and sha256 of every file in the folder, checked at every load.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from model.atomic import atomic_path, sha256_file
from model.backbone import BACKBONE_NAME, onnx_graph, quant_recipe
from model.bundle import Bundle
from model.config import default_artifacts_dir, default_data_dir
from model.data import load_split
from model.dataset import load_split_data
from model.onnx import graph_dir
from model.parsers import make_parser
from model.release import MANIFEST, MANIFEST_FORMAT, RELEASE_DIR, read_manifest
from model.resources import cpu_info
from training.distill import teacher_paths
from training.evaluate import evaluate

logger = logging.getLogger(__name__)

REPORTED = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10", "annot_medr",
            "search_medr")
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
              "avx512_bf16", "amx_int8")
ROOT = Path(__file__).resolve().parent.parent


def cpu_record() -> dict[str, Any]:
    """The CPU's model name and the SIMD flags that choose ONNX Runtime's kernels."""
    cpu = cpu_info()
    return {"model": cpu.model, "flags": [f for f in SIMD_FLAGS if f in cpu.flags]}


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


def manifest_of(bundle: Bundle, model: Path, data: Path, dev: dict[str, float], command: str) -> dict[str, Any]:
    """Everything but `files` (added once the folder is written)."""
    history = model.parent / "history.json"
    trained = json.loads(history.read_text()) if history.is_file() else {}
    selection = dict(bundle.meta.get("selection", {}))
    import onnxruntime

    cfg = bundle.image_cfg
    features: dict[str, Any] = {"backbone": cfg.backbone, "precision": cfg.backbone_precision,
                                "region_features": cfg.region_features, "regions": cfg.n_regions,
                                "onnxruntime": onnxruntime.__version__, "cpu": cpu_record()}
    if cfg.backbone_precision == "int8":
        graph = onnx_graph("int8", graph_dir(), weights=cfg.backbone_weights, backbone=cfg.backbone)
        features.update(quantization=quant_recipe(), graph=graph.name, graph_sha256=sha256_file(graph))
    rel = bundle.relevance
    return {
        "format": MANIFEST_FORMAT,
        "name": str(bundle.meta.get("variant") or model.parent.name),
        "row": model.parent.name,
        "made_by": {"command": command, **git_commit(),
                    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "training_command": trained.get("command"), "member_epochs": trained.get("member_epochs"),
                    **teacher_of(model)},
        "model": {"h": bundle.dim, "blocks": bundle.blocks, "words": len(bundle.text.words.words),
                  "relevance": None if rel is None else rel.to_state()},
        "training": {**split_digests(data, "train"),
                     "validation_part": {k: selection[k] for k in ("rule", "images", "seed") if k in selection}},
        "features": features,
        "metrics": {"validation": rounded(selection.get("val", {})), "dev": rounded(dev)},
    }


def write_release(bundle: Bundle, out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Save the checkpoint into `out` as model.pt (in the current format: the calibration's padding left
    out) and write the manifest with every file's size and sha256 (each write atomic: a crash leaves the
    previous release whole, or the new file beside the old manifest, which then refuses it by name)."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.pt"
    bundle.save(target)
    files = {"model.pt": {"bytes": target.stat().st_size, "sha256": sha256_file(target)}}
    manifest = {**manifest, "files": files}
    with atomic_path(out / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    read_manifest(out)  # what was written reads back as a release
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the trained checkpoint (model.pt) to release")
    ap.add_argument("--out", type=Path, default=RELEASE_DIR, help="the release folder (default: model/released)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_artifacts_dir() / "cache", help="the feature cache")
    ap.add_argument("--dev-split", default="dev", help="the split the release's dev metrics are measured on")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bundle = Bundle.load(args.model)
    if bundle.relevance is None or not bundle.meta.get("selection", {}).get("val"):
        ap.error(f"{args.model} has no relevance scale or no validation metrics: a release is trained with "
                 "--selection val (python -m training.train --selection val ...)")
    if bundle.image_cfg.backbone != BACKBONE_NAME:
        ap.error(f"{args.model} needs the {bundle.image_cfg.backbone} weight package, which the project does not "
                 "install: a release uses the locked packages only")
    dev_data = load_split_data(args.data, args.dev_split, bundle.image_cfg, args.cache,
                               make_parser(bundle.text.cfg.parser), workers=args.workers)
    dev = evaluate(bundle, dev_data)
    logger.info("dev R-sum %.2f (annotation R@1 %.1f, search R@1 %.1f)", dev["rsum"], dev["annot_r1"],
                dev["search_r1"])
    command = "python -m training.release " + shlex.join(sys.argv[1:] if argv is None else argv)
    manifest = write_release(bundle, args.out, manifest_of(bundle, args.model, args.data, dev, command))
    Bundle.load(args.out / "model.pt")  # the release loads, checked against its manifest
    logger.info("released %s into %s: %s", manifest["name"], args.out,
                ", ".join(f"{n} {f['bytes'] / 1e6:.1f} MB" for n, f in manifest["files"].items()))


if __name__ == "__main__":
    main()
