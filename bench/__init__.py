"""Benchmarks: each prints ratios measured side by side and writes its results under docs/results."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData, load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.model.resources import cpu_info
from fragsearch.settings import default_artifacts_dir, default_cache_dir, default_data_dir


def machine() -> str:
    """CPU model (from /proc/cpuinfo) and logical core count."""
    name = cpu_info().model
    model = "unknown CPU" if name == "unknown" else name
    return f"{model} x {os.cpu_count()} cores"


def parse_run(ap: argparse.ArgumentParser, argv: list[str] | None, module: str) -> tuple[argparse.Namespace, str]:
    """Parse a benchmark's flags, set up logging, and the command line written beside its results."""
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args, f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


def add_model_args(ap: argparse.ArgumentParser, out: Path) -> None:
    """The flags of the benchmarks that evaluate trained models on a split: where models, data,
    caches and results are."""
    ap.add_argument("--models", type=Path, default=default_artifacts_dir() / "models",
                    help="folder of trained models, one <name>/model.pt each")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--split", default="dev", help="split evaluated on (reported, never used to choose a model)")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(),
                    help="the feature, parse and vector cache")
    ap.add_argument("--out", type=Path, default=out, help="the results file written")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows already in the results of models not evaluated in this run")


# a child process where `import torch` fails (a finder ahead of the others, before anything else is imported), as in
# the runtime environment (where torch is installed, spaCy's thinc imports it and adds about 500 MB): it runs
# argv[1] ("module:function") on the JSON list argv[2] and prints the JSON answer
NO_TORCH_CHILD = """
import importlib, json, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not in the runtime environment")
sys.meta_path.insert(0, NoTorch())
module, name = sys.argv[1].rsplit(":", 1)
print(json.dumps(getattr(importlib.import_module(module), name)(*json.loads(sys.argv[2]))))
"""


def run_without_torch(target: str, params: list[Any]) -> Any:
    """`target` ("module:function") called with `params` in a child process without torch (`NO_TORCH_CHILD`): its
    JSON answer; SystemExit with the child's error when it fails."""
    child = subprocess.run([sys.executable, "-c", NO_TORCH_CHILD, target, json.dumps(params)], capture_output=True,
                           text=True, check=False, cwd=Path(__file__).resolve().parent.parent)
    if child.returncode:
        raise SystemExit(f"the measuring process failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def write_rows(path: Path, fields: list[str], rows: list[dict[str, object]]) -> None:
    """A results CSV: the header, then the rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    logging.getLogger("bench").info("wrote %s", path)


def write_result(path: Path | None, result: dict[str, object]) -> None:
    """A benchmark's JSON result: logged, and written to `path` when one is given."""
    text = json.dumps(result, indent=2)
    logging.getLogger("bench").info("%s", text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def kept_rows(path: Path, merge: bool, evaluated: list[str]) -> list[dict[str, str]]:
    """With `merge`: the rows of a results CSV whose model is not among `evaluated` (else none)."""
    if not merge or not path.is_file():
        return []
    with path.open(newline="") as f:
        return [r for r in csv.DictReader(f) if r["model"] not in evaluated]


class SplitDataByConfig:
    """A split's data loaded once per image settings and parser, shared by the models that use them."""

    def __init__(self, data: Path, split: str, cache: Path) -> None:
        self.data, self.split, self.cache = data, split, cache
        self._loaded: dict[str, SplitData] = {}

    def get(self, bundle: Bundle) -> SplitData:
        key = json.dumps([bundle.image_cfg.__dict__, bundle.text.cfg.parser], sort_keys=True, default=str)
        if key not in self._loaded:
            self._loaded[key] = load_split_data(self.data, self.split, bundle.image_cfg, self.cache,
                                                make_parser(bundle.text.cfg.parser))
        return self._loaded[key]


def made_extractor(cfg: Any, places: Any = None) -> Any:
    """A RegionExtractor of ``cfg`` after the export step of the graphs it runs (training/graphs.py; the benches
    run in the trainer's environment)."""
    from fragsearch.model.image import RegionExtractor
    from fragsearch.model.places import DEFAULT_PLACES
    from fragsearch.training.graphs import make_graphs

    make_graphs(cfg, places or DEFAULT_PLACES)
    return RegionExtractor(cfg, places=places or DEFAULT_PLACES)


def made_backbone(precision: str, runtime: str = "auto") -> Any:
    """The ImageNet Lite0 at ``precision`` on the CPU (model/backbone.py `Backbone`), its graph made first where
    missing (the export step, training/graphs.py)."""
    from fragsearch.model.backbone import Backbone
    from fragsearch.model.config import ImageConfig
    from fragsearch.model.places import DEFAULT_PLACES
    from fragsearch.training.graphs import make_graphs

    make_graphs(ImageConfig(backbone_precision=precision), DEFAULT_PLACES, head=True)
    return Backbone("cpu", precision, runtime)
