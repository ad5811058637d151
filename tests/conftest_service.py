"""Service fixtures: indexes over the coloured-shapes data and apps built on them.

Used by the service test modules through `pytest_plugins = ["tests.conftest_service"]` (they take
the limits and the key from the `service_env` fixture rather than importing this module).
The read-only engine is shared by the session; tests that write get their own copy of the indexes.
"""

from __future__ import annotations

import dataclasses
import io
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from fragsearch.index import ImageIndex, IndexSettings, SentenceIndex
from fragsearch.index.types import BackendOptions
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from fragsearch.settings import Settings
from tests.conftest import ShapesModel

API_KEY = "test-key-123"
MAX_UPLOAD = 300_000
MAX_PIXELS = 2_000_000
K_MAX = 40
MAX_CHARS = 200
DEADLINE = 600.0
# The suite's indexes search through their candidates, never by the exact scan that answers collections
# this small by default (exact_below=0), and recall everything: k' beyond every fragment the image index
# will hold, and every sentence fragment with a positive score without a re-rank limit. So every ranked
# route goes through the backend (FAISS or Milvus) and the exact re-rank, and answers as the scan does
# (test_service.py compares the two, and checks the path on /metrics).
IMAGE_SETTINGS = IndexSettings.of(exact_below=0, k_prime=4096)
SENTENCE_SETTINGS = IndexSettings.of(exact_below=0, k_prime=0, rerank=0)


@dataclass
class ServiceEnv:
    """root: the folder holding images/ and sentences/ indexes; dev: the dev image names;
    captions: image name -> its captions; settings: the settings the test apps use."""

    root: Path
    shapes: ShapesModel
    settings: Settings
    engine: Engine
    dev: list[str]
    captions: dict[str, list[str]]

    def image_path(self, name: str) -> Path:
        return self.shapes.data / "images" / name

    def jpeg(self, name: str | None = None) -> bytes:
        """A dev image's file bytes (the first dev image by default)."""
        return self.image_path(name or self.dev[0]).read_bytes()

    api_key: str = API_KEY

    @staticmethod
    def png(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
        return png_bytes(width, height, colour)

    @staticmethod
    def prepared(c: TestClient, timeout: float = 600.0) -> dict[str, Any]:
        """Wait until an app started with `prepare=True` is ready (every answer before says it is
        preparing); returns the body of its GET /readyz."""
        deadline = time.monotonic() + timeout
        while (r := c.get("/readyz")).status_code != 200:
            assert r.json()["status"] == "preparing", r.json()
            assert time.monotonic() < deadline, "preparation did not finish"
            time.sleep(0.05)
        body: dict[str, Any] = r.json()
        return body

    def settings_for(self, root: Path, **overrides: object) -> Settings:
        """The test settings with indexes and uploads under `root`."""
        return make_settings(self.shapes, root, **{"index_backend": self.settings.index_backend, **overrides})

    def writable(self, tmp: Path, bundle: Bundle | None = None, **overrides: object) -> tuple[Settings, Engine]:
        """Settings and an engine over a private copy of the indexes (and its own uploads folder); `bundle`:
        the same model with another calibration (the indexes do not depend on it), else the shapes model."""
        shutil.copytree(self.root / "images", tmp / "images")
        shutil.copytree(self.root / "sentences", tmp / "sentences")
        settings = self.settings_for(tmp, **overrides)
        bundle = bundle or self.shapes.bundle
        engine = Engine(settings, bundle, ImageIndex.load(tmp / "images", bundle),
                        SentenceIndex.load(tmp / "sentences", bundle))
        return settings, engine


def make_settings(shapes: ShapesModel, root: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "data": shapes.data, "artifacts": root, "model_path": shapes.model_path,
        "image_index": root / "images", "sentence_index": root / "sentences", "uploads": root / "uploads",
        "cache": shapes.cache, "api_key": API_KEY, "warmup": False, "k_max": K_MAX,
        "max_upload_bytes": MAX_UPLOAD, "max_pixels": MAX_PIXELS, "max_sentence_chars": MAX_CHARS,
        # deadlines far beyond any request's work, so that no test depends on how busy the machine is
        # (test_service_overload.py sets short ones where the deadline itself is tested)
        "heavy_deadline": DEADLINE, "search_deadline": DEADLINE,
        # one pytest process serves many apps: freezing each one's objects would keep them all alive
        # (test_service.py checks the freeze itself)
        "freeze_heap": False,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.fixture(scope="session", params=["faiss", "milvus"])
def service_env(request: pytest.FixtureRequest, shapes_model: ShapesModel,
                tmp_path_factory: pytest.TempPathFactory) -> ServiceEnv:
    """Indexes of the dev images and of the train + dev captions, with their candidates in FAISS or in
    Milvus (milvus-lite in each index folder): every service test runs on both, through the candidates."""
    backend = BackendOptions(request.param)
    root = tmp_path_factory.mktemp(f"service-{backend.backend}")
    bundle = shapes_model.bundle
    dev = load_split(shapes_model.data, "dev")
    train = load_split(shapes_model.data, "train")
    cache = feature_cache(shapes_model.cache, bundle.image_cfg)
    images = ImageIndex.create(root / "images", bundle, IMAGE_SETTINGS, cache=cache, backend=backend)
    images.photos.add([dev.image_path(n) for n in dev.images])
    images.save()
    sentences = SentenceIndex.create(root / "sentences", bundle, SENTENCE_SETTINGS, backend=backend)
    texts, _ = train.sentences()
    dev_texts, _ = dev.sentences()
    sentences.add(texts + dev_texts)
    sentences.save()
    settings = make_settings(shapes_model, root, index_backend=backend.backend)
    engine = Engine(settings, bundle, images, sentences)
    captions = {n: list(c) for n, c in zip(dev.images, dev.captions, strict=True)}
    return ServiceEnv(root, shapes_model, settings, engine, list(dev.images), captions)


@pytest.fixture(scope="session")
def service_app(service_env: ServiceEnv) -> FastAPI:
    """The read-only app over the shared engine (tests through it must not write)."""
    return create_app(service_env.settings, engine=service_env.engine)


@pytest.fixture(scope="session")
def client(service_app: FastAPI) -> Iterator[TestClient]:
    with TestClient(service_app) as c:
        yield c


@pytest.fixture
def writable(service_env: ServiceEnv, tmp_path: Path) -> Iterator[tuple[TestClient, Engine]]:
    """A client of an app over a private copy of the indexes: writes allowed."""
    settings, engine = service_env.writable(tmp_path)
    with TestClient(create_app(settings, engine=engine)) as c:
        yield c, engine


def png_bytes(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, "PNG")
    return buf.getvalue()


def engine_over_dev(shapes: ShapesModel, bundle: Bundle, root: Path, only: Sequence[str] | None = None,
                    **overrides: object) -> Engine:
    """An engine of `bundle` over indexes of the shapes dev images (`only`: these of them) and training captions
    (FAISS); `overrides`: settings other than the suite's (make_settings)."""
    dev = load_split(shapes.data, "dev")
    images = ImageIndex.create(root / "images", bundle, IMAGE_SETTINGS, cache=feature_cache(shapes.cache,
                                                                                             bundle.image_cfg))
    images.photos.add([dev.image_path(n) for n in dev.images if only is None or n in only])
    images.save()
    sentences = SentenceIndex.create(root / "sentences", bundle, SENTENCE_SETTINGS)
    sentences.add(load_split(shapes.data, "train").sentences()[0])
    sentences.save()
    return Engine(make_settings(shapes, root, **overrides), bundle, images, sentences)


@pytest.fixture(scope="session")
def calibrated_checkpoint(shapes_model: ShapesModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shapes model calibrated on training images, its relevance scale fitted on 20 held-out ones with the
    rest beside them (as training fits it on the validation part), saved."""
    from fragsearch.model.dataset import hold_out, load_split_data
    from fragsearch.model.parsers import make_parser
    from fragsearch.training.calibrate import fit_calibration
    from fragsearch.training.nets.checkpoint import Checkpoint
    from fragsearch.training.relevance import fit_relevance, judge

    ckpt = Checkpoint.load(shapes_model.model_path)
    train = load_split_data(shapes_model.data, "train", ckpt.image_cfg, shapes_model.cache, make_parser("spacy"))
    rest, val = hold_out(train, 20, 0)
    ckpt.calibration = fit_calibration(ckpt, rest, refs=20, seed=0)
    ckpt.calibration.relevance = fit_relevance(judge(ckpt, val, rest))
    path = tmp_path_factory.mktemp("calibrated-model") / "model.pt"
    ckpt.save(path)
    return path


@pytest.fixture(scope="session")
def calibrated_engine(shapes_model: ShapesModel, calibrated_checkpoint: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The calibrated shapes model (`calibrated_checkpoint`) over its own indexes."""
    from fragsearch.training.nets.checkpoint import Checkpoint

    ckpt = Checkpoint.load(calibrated_checkpoint)
    return engine_over_dev(shapes_model, ckpt.bundle(), tmp_path_factory.mktemp("calibrated"))


@pytest.fixture(scope="session")
def evidence_model(shapes_model: ShapesModel, calibrated_checkpoint: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The calibrated shapes model with phrase evidence fitted on its training images (no Entities annotations:
    the things a caption names are present in its own picture) and its relevance refitted with the evidence on
    the same 20 held-out images, saved as a folder (its path)."""
    from fragsearch.model.dataset import hold_out, load_split_data
    from fragsearch.model.parsers import make_parser
    from fragsearch.training.evidence import fit_evidence, fit_relevance_with_evidence
    from fragsearch.training.nets.checkpoint import Checkpoint

    bundle = Checkpoint.load(calibrated_checkpoint).bundle()
    train = load_split_data(shapes_model.data, "train", bundle.image_cfg, shapes_model.cache, make_parser("spacy"))
    rest, val = hold_out(train, 20, 0)
    scale, report = fit_evidence(bundle, train, tmp_path_factory.mktemp("no-entities") / "absent")
    assert report["fitted"]["auc"] > 0.8, report
    bundle.set_evidence(scale)
    relevance = fit_relevance_with_evidence(bundle, scale, val, rest, {})
    assert bundle.calibration is not None
    bundle.calibration = dataclasses.replace(bundle.calibration, relevance=relevance)
    folder = tmp_path_factory.mktemp("evidence-model") / "model"
    bundle.save(folder)
    return folder


@pytest.fixture(scope="session")
def evidence_bundle(evidence_model: Path) -> Bundle:
    """`evidence_model`, loaded."""
    return Bundle.load(evidence_model)


def without_shape(shapes: ShapesModel, shape: str) -> list[str]:
    """The shapes dev images that hold no `shape`."""
    dev = load_split(shapes.data, "dev")
    return [n for n in dev.images if all(o["shape"] != shape for o in shapes.objects[n])]


@pytest.fixture(scope="session")
def evidence_engine(shapes_model: ShapesModel, evidence_model: Path, evidence_bundle: Bundle,
                    tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The shapes model with phrase evidence over the dev images that hold no triangle (its settings name the
    model's folder: a command reads the same)."""
    return engine_over_dev(shapes_model, evidence_bundle, tmp_path_factory.mktemp("evidence"),
                           only=without_shape(shapes_model, "triangle"), model_path=evidence_model)
