"""Settings are read at the door and passed down: the settings live with the commands (fragsearch/settings.py,
fragsearch/commands/), the runtime (model/) and the index package read none of their own, and where the runtime
finds and makes its files (model/places.py `Places`) is what the command's flags say."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import pkgutil
from pathlib import Path
from unittest import mock

import pytest

from fragsearch.commands.flags import FIELD, REGION_FLAGS, add_setting_flags
from fragsearch.commands.options import settings_from, settings_parser
from fragsearch.index.images import ImageIndex
from fragsearch.index.types import IndexSettings, IndexShape, SearchSettings
from fragsearch.model.config import TrainConfig
from fragsearch.model.places import Places
from fragsearch.model.variants import MODEL_SHAPE
from fragsearch.service.engine import Engine
from fragsearch.settings import Settings
from tests.conftest import ShapesModel, exported

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "fragsearch.settings"



def imports_settings(path: Path) -> bool:
    """Whether `path` imports the settings module anywhere in its body (function-local imports included)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == SETTINGS for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                node.module == SETTINGS or node.module == "fragsearch" and any(a.name == "settings"
                                                                               for a in node.names)):
            return True
    return False


def test_the_finder_sees_a_local_import_of_the_settings(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from fragsearch.settings import from_environment\n")
    (tmp_path / "b.py").write_text("from fragsearch import settings\n")
    (tmp_path / "c.py").write_text("from fragsearch.model.places import Places\n")
    assert [imports_settings(tmp_path / n) for n in ("a.py", "b.py", "c.py")] == [True, True, False]


def readers(package: str) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / package).rglob("*.py")) if imports_settings(p)]


def test_the_runtime_reads_no_settings() -> None:
    """Every module of model/ (the torch side included) takes what it needs as arguments; the settings are not
    in the model package at all (no host, port or API key there)."""
    assert len(list((ROOT / "model").rglob("*.py"))) > 40
    assert readers("model") == []
    assert not (ROOT / "model" / "settings.py").exists()


def imports_argparse(path: Path) -> bool:
    return any(isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names)
               or isinstance(node, ast.ImportFrom) and node.module == "argparse"
               for node in ast.walk(ast.parse(path.read_text(), str(path))))


def parsers(package: str) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / package).rglob("*.py")) if imports_argparse(p)]


def test_the_trainer_and_the_runtime_read_no_settings_and_parse_no_command_line() -> None:
    """train, release, evaluate, calibrate, finetune, merge, cutpoint, extract, the refits, `data` and the graph
    exports are commands in fragsearch/commands/, reading the settings there and passing what they read down;
    `python -m fragsearch.training.train` and the like stay as aliases that call them."""
    assert len(list((ROOT / "training").rglob("*.py"))) > 15
    assert readers("training") == []
    assert parsers("training") == []
    assert parsers("model") == []
    assert len(parsers("fragsearch/commands")) >= 15


def test_the_service_parses_no_command_line() -> None:
    """serve, prepare, search, annotate, the settings table and the API reference are commands of
    fragsearch/commands/ too; `python -m fragsearch.service` (the README's) and the service's other `python -m`
    lines are aliases that call them."""
    assert parsers("service") == []
    assert {"serve.py", "prepare.py", "terminal.py", "options.py", "api_docs.py"} <= {
        p.name for p in (ROOT / "fragsearch" / "commands").glob("*.py")}


def test_the_finder_sees_a_local_import_of_argparse(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    import argparse\n")
    (tmp_path / "b.py").write_text("def f():\n    from argparse import ArgumentParser\n")
    (tmp_path / "c.py").write_text("import argparsers\n")
    assert [imports_argparse(tmp_path / n) for n in ("a.py", "b.py", "c.py")] == [True, True, False]


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of every command in fragsearch/commands/ (each main's, taken when it parses)."""
    import fragsearch.commands

    found: dict[str, argparse.ArgumentParser] = {}
    for info in pkgutil.iter_modules(fragsearch.commands.__path__):
        module = importlib.import_module(f"fragsearch.commands.{info.name}")
        for name in ("main", "backbone_main", "minilm_main"):
            main = getattr(module, name, None)
            if callable(main):
                with (mock.patch.object(argparse.ArgumentParser, "parse_args", autospec=True,
                                        side_effect=Taken) as parse, contextlib.suppress(Taken)):
                    main([])
                if parse.call_args is not None:
                    found[f"{info.name}.{name}"] = parse.call_args.args[0]
    return found


class Taken(Exception):
    pass


def field_flags(trainer: bool = False) -> dict[str, set[str]]:
    """Each flag named like a field of the settings, of an index's settings, of the image fragments' settings or
    with `trainer`, of the trainer's (a second index's flags with their prefix): the fields it may have been made
    from. The trainer's fields are train's alone: finetune's --epochs or calibrate's --seed are their own."""
    named: dict[str, set[str]] = {}

    def add(option: str, made_from: str) -> None:
        named.setdefault(option, set()).add(made_from)

    for name in Settings.model_fields:
        add("--" + name.replace("_", "-"), f"Settings.{name}")
    for cls in (IndexShape, SearchSettings):
        for f in dataclasses.fields(cls):
            for prefix in ("", "sentence-"):
                add(f"--{prefix}{f.name.replace('_', '-')}", f"{cls.__name__}.{f.name}")
    for name in REGION_FLAGS:
        add("--" + name.replace("_", "-"), f"ImageConfig.{name}")
    for f in dataclasses.fields(TrainConfig) if trainer else ():
        add("--" + f.name.replace("_", "-"), f"TrainConfig.{f.name}")
    for name in MODEL_SHAPE if trainer else ():
        add("--" + name.replace("_", "-"), f"ModelConfig.{name}")
    return named


def test_no_command_declares_a_setting_by_hand() -> None:
    """A setting a command reads (the data folder, the cache, the workers, the device, the variant, an index's
    k_prime, a region flag ...) is a flag made from its field by the one generator (fragsearch/commands/flags.py:
    the field's help and type, for a setting FRAGSEARCH_<NAME>, .env and fragsearch.toml), never a flag of the
    command's own with a default or a meaning of its own."""
    meaning = {"--" + name.replace("_", "-"): field.description or "" for name, field in Settings.model_fields.items()}
    parsers = command_parsers()
    assert len(parsers) >= 20

    def by_hand(command: str, ap: argparse.ArgumentParser) -> list[str]:
        named = field_flags(trainer=command == "train.main")

        def generated(option: str, action: argparse.Action) -> bool:  # made from a field, by the generator
            made_from = getattr(action, FIELD, None)
            if made_from not in named[option]:
                return False
            return not made_from.startswith("Settings.") or (action.help or "").startswith(meaning[option])

        return [option for action in ap._actions for option in action.option_strings
                if option in named and not generated(option, action)]

    hand = {command: by_hand(command, ap) for command, ap in parsers.items()}
    assert {command: flags for command, flags in hand.items() if flags} == {}
    made = {o: getattr(a, FIELD) for a in parsers["train.main"]._actions for o in a.option_strings if hasattr(a, FIELD)}
    assert made["--workers"] == "Settings.workers" and made["--crop-size"] == "ImageConfig.crop_size"
    assert made["--epochs"] == "TrainConfig.epochs" and made["--text-layers"] == "ModelConfig.text_layers"
    made = {o: getattr(a, FIELD) for a in parsers["index_build.main"]._actions for o in a.option_strings
            if hasattr(a, FIELD)}
    assert made["--k-prime"] == "SearchSettings.k_prime" and made["--sentence-rerank"] == "SearchSettings.rerank"


def test_the_guard_sees_a_flag_made_by_hand() -> None:
    """A command's own `--cache` or `--crop-size` is not one the generator made."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--crop-size", type=int, default=224)
    add_setting_flags(ap, ("data",))
    marks = {o: getattr(a, FIELD, None) for a in ap._actions for o in a.option_strings}
    assert marks["--crop-size"] is None and marks["--data"] == "Settings.data"
    assert "ImageConfig.crop_size" in field_flags()["--crop-size"]


def test_the_index_reads_no_settings_and_parses_no_command_line() -> None:
    """Its commands (build, bulk, sync, duplicates) and their flags live with the others (fragsearch/commands/);
    `python -m fragsearch.index.build` and the like stay as aliases that call them."""
    assert readers("index") == []
    assert parsers("index") == []
    assert readers("fragsearch/commands")


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
    exported(tmp_path / "flags-cache", shapes_model.bundle.image_cfg)  # the export step for that cache
    flags = ["--artifacts", str(tmp_path / "flags"), "--cache", str(tmp_path / "flags-cache"),
             "--model-path", str(shapes_model.model_path), "--image-index", str(index), "--collection", str(photos),
             "--device", "cpu"]
    ap = settings_parser()
    settings = settings_from(ap, ap.parse_args(flags))
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
