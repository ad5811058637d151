"""Shared fixtures: a small coloured-shapes data set and a model trained on it for a few seconds; and
the `required` marker: a test that needs something the machine may lack, which CI must run.

    pytestmark = pytest.mark.required(CHROMIUM.is_file(), reason="chromium is absent")

Where the condition is false the test is skipped, or, with CI=true in the environment (`.ci/run`
sets it), fails: a CI run cannot pass without running it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from fragsearch.model.bundle import Bundle
from fragsearch.model.config import ImageConfig
from fragsearch.model.dataset import SplitData, load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.model.places import DEFAULT_PLACES, Places
from fragsearch.training.graphs import make_graphs
from fragsearch.training.train import make_run, train
from tests.synthetic import make_dataset


@dataclass
class ShapesModel:
    """data: the data folder (images/, captions.txt, train.txt, dev.txt, objects.json);
    model_path: a trained checkpoint; cache: the feature/parse cache; dev: the dev split loaded."""

    data: Path
    model_path: Path
    cache: Path
    bundle: Bundle
    dev: SplitData
    objects: dict[str, list[dict[str, object]]]
    summary: dict[str, object]


def exported(cache: Path, cfg: ImageConfig) -> Path:
    """`cache` after the export step of the graphs an extractor of `cfg` runs (training/graphs.py): the runtime
    looks them up in `<cache>/graphs` and never makes them."""
    make_graphs(cfg, Places(cache=Path(cache)))
    return Path(cache)


@pytest.fixture(scope="session")
def shapes_model(tmp_path_factory: pytest.TempPathFactory) -> ShapesModel:
    root = tmp_path_factory.mktemp("shapes")
    objects = make_dataset(root / "data", n_train=60, n_dev=20)
    run = make_run("paper", {"epochs": 30, "dense_epochs": 10, "anneal_epochs": 3, "batch_size": 20, "h": 64,
                             "lr": 3e-3, "eval_every": 10})
    parser = make_parser("spacy")
    cache = root / "cache"
    for places in (DEFAULT_PLACES, Places(cache=cache)):  # the export step: where its users look for its graphs
        make_graphs(run.image, places, head=True)
    tr = load_split_data(root / "data", "train", run.image, cache, parser)
    dev = load_split_data(root / "data", "dev", run.image, cache, parser)
    summary = train(run, tr, None, root / "model", cache)  # the last epoch: dev selects nothing
    path = root / "model" / "model.pt"
    return ShapesModel(root / "data", path, cache, Bundle.load(path), dev, objects, summary)


@dataclass
class OtherFeaturesModel:
    """A small model on the shapes data that reads other image features than `shapes_model` (one region
    fewer), its training and dev splits loaded with them."""

    model_path: Path
    bundle: Bundle
    train: SplitData
    dev: SplitData


@pytest.fixture(scope="session")
def other_features_model(shapes_model: ShapesModel, tmp_path_factory: pytest.TempPathFactory) -> OtherFeaturesModel:
    run = make_run("paper", {"epochs": 6, "dense_epochs": 2, "anneal_epochs": 1, "batch_size": 20, "h": 32,
                             "lr": 3e-3, "seed": 3})
    cfg = shapes_model.bundle.image_cfg
    run.image = dataclasses.replace(cfg, n_regions=cfg.n_regions - 1)
    parser = make_parser("spacy")
    tr = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, parser)
    dev = load_split_data(shapes_model.data, "dev", run.image, shapes_model.cache, parser)
    out = tmp_path_factory.mktemp("other-features")
    train(run, tr, None, out, shapes_model.cache)
    return OtherFeaturesModel(out / "model.pt", Bundle.load(out / "model.pt"), tr, dev)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "required(available, reason): needs what the machine may lack; skipped "
                            "where `available` is false, failed there under CI=true (tests/conftest.py)")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `required` test whose dependency is missing: skipped, or failed under CI (before its fixtures)."""
    for mark in item.iter_markers("required"):
        available = mark.args[0] if mark.args else mark.kwargs["available"]
        if not available:
            reason = str(mark.kwargs.get("reason", "a dependency is missing"))
            if in_ci():
                pytest.fail(f"required test cannot run under CI: {reason}", pytrace=False)
            pytest.skip(reason)
