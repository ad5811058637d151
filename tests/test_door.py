"""Settings are read at the door and passed down: the runtime (model/) reads no settings of its own, and where
it finds and makes its files (model/places.py `Places`) is what the command's flags say."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fragsearch.index.images import ImageIndex
from fragsearch.index.types import IndexSettings
from fragsearch.model.places import Places
from fragsearch.service.engine import Engine
from fragsearch.service.settings import settings_from, settings_parser
from tests.conftest import ShapesModel

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "fragsearch.model.settings"


def imports_settings(path: Path) -> bool:
    """Whether `path` imports the settings module anywhere in its body (function-local imports included)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == SETTINGS for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                node.module == SETTINGS or node.module == "fragsearch.model" and any(a.name == "settings"
                                                                                     for a in node.names)):
            return True
    return False


def test_the_finder_sees_a_local_import_of_the_settings(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from fragsearch.model.settings import current\n")
    (tmp_path / "b.py").write_text("from fragsearch.model import settings\n")
    (tmp_path / "c.py").write_text("from fragsearch.model.places import Places\n")
    assert [imports_settings(tmp_path / n) for n in ("a.py", "b.py", "c.py")] == [True, True, False]


def test_the_runtime_reads_no_settings() -> None:
    """Every module of model/ (the torch side included) but the settings' own takes what it needs as arguments."""
    runtime = [p for p in sorted((ROOT / "model").rglob("*.py")) if p.name != "settings.py"]
    assert len(runtime) > 40
    readers = [str(p.relative_to(ROOT)) for p in runtime if imports_settings(p)]
    assert readers == []


def test_a_flag_of_serve_reaches_the_runtime_below_it(shapes_model: ShapesModel, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`fragsearch serve --artifacts A --cache C`: the model the service loads finds and makes its graphs in
    C/graphs and reads backbone weights against A, its text pipeline and its extractor's backbones too, and a
    collection's feature cache extracts with the same places; the folder the environment names is not read."""
    monkeypatch.setenv("FRAGSEARCH_ARTIFACTS", str(tmp_path / "environment"))
    index = tmp_path / "images"
    ImageIndex.create(index, shapes_model.bundle, IndexSettings()).save()
    photos = tmp_path / "photos"
    photos.mkdir()
    flags = ["--artifacts", str(tmp_path / "flags"), "--cache", str(tmp_path / "flags-cache"),
             "--model-path", str(shapes_model.model_path), "--image-index", str(index), "--collection", str(photos),
             "--device", "cpu"]
    ap, cli = settings_parser()
    settings = settings_from(ap, cli, ap.parse_args(flags))
    want = Places(tmp_path / "flags", tmp_path / "flags-cache")
    assert settings.places == want
    engine = Engine.load(settings, with_sentences=False)
    try:
        bundle = engine.bundle
        assert bundle.places == want
        assert bundle.text.graphs == tmp_path / "flags-cache" / "graphs"
        assert bundle.extractor.places == want
        assert bundle.extractor.ranker.places == want and bundle.extractor.backbone.places == want
        cache = engine.images.photos.cache
        assert cache is not None and cache.places == want and cache.root == tmp_path / "flags-cache" / "features"
    finally:
        engine.images.close()
    assert not (tmp_path / "environment").exists()
