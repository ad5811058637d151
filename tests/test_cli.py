"""The `fragsearch` command line: its subcommands, a search and an annotation from the saved indexes without a
server, and one configuration for every subcommand (flags > FRAGSEARCH_* > .env > fragsearch.toml >
defaults; no module but fragsearch/settings.py reads a FRAGSEARCH_* variable)."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import random
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fragsearch import cli
from fragsearch.cli import main as cli_main
from fragsearch.index import ImageIndex
from fragsearch.index.sync import MANIFEST
from fragsearch.settings import Settings, from_environment
from tests.synthetic import make_picture

if TYPE_CHECKING:
    from tests.conftest import ShapesModel
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = tuple(sub.name for sub in cli.SUBCOMMANDS)
# commands reached by `python -m` alone: the generators of the docs' settings table and API reference
DOCS_ONLY = {"options:main", "api_docs:main"}
PRODUCT = ("fragsearch", "model", "index", "service", "training", "bench", "tools")


def picture(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    make_picture(random.Random(seed))[0].save(path, "JPEG", quality=90)


def fragsearch(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`fragsearch ARGS` in this process: its exit status, stdout and stderr."""
    with pytest.raises(SystemExit) as done:
        cli_main(args)
    out = capsys.readouterr()
    code = done.value.code
    return (code if isinstance(code, int) else 1 if code else 0), out.out, out.err


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A working folder without .env or fragsearch.toml, and no FRAGSEARCH_* variable set."""
    import os

    for name in [n for n in os.environ if n.startswith("FRAGSEARCH_")]:
        monkeypatch.delenv(name)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_the_help_lists_every_subcommand() -> None:
    out = subprocess.run([sys.executable, "-m", "fragsearch", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.split("Commands:")[1].splitlines() if line.strip()]
    assert sorted(listed) == sorted(SUBCOMMANDS)


def test_every_command_is_a_subcommand() -> None:
    """Each command of fragsearch/commands/ (each module's main, and its other mains) is `fragsearch NAME`."""
    import fragsearch.commands

    mains = {f"{info.name}:{name}" for info in pkgutil.iter_modules(fragsearch.commands.__path__)
             for name, value in vars(importlib.import_module(f"fragsearch.commands.{info.name}")).items()
             if callable(value) and (name == "main" or name.endswith("_main"))
             and getattr(value, "__module__", "") == f"fragsearch.commands.{info.name}"}
    reached = {sub.main for sub in cli.SUBCOMMANDS}
    assert mains - DOCS_ONLY == reached
    assert len(set(SUBCOMMANDS)) == len(SUBCOMMANDS) >= 20


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_each_subcommand_says_what_it_reads(command: str, capsys: pytest.CaptureFixture[str], clean: Path) -> None:
    code, out, _ = fragsearch([command, "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: fragsearch {command}"), out[:200]


def test_search_and_annotate_answer_from_the_saved_indexes(shapes_model: ShapesModel, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str], clean: Path) -> None:
    """`fragsearch index DIR` then `fragsearch search` (paths, -f, --json) and `fragsearch annotate`: the
    candidate stage on (exact_below=0), as a large collection would search."""
    photos = tmp_path / "Pictures"
    for n in range(6):
        picture(photos / ("trip" if n % 2 else "") / f"p{n}.jpg", 40 + n)
    common = ["--model-path", str(shapes_model.model_path), "--artifacts", str(tmp_path / "a"),
              "--collection", str(photos)]
    assert fragsearch(["index", "--workers", "1", "--cache", str(shapes_model.cache), *common], capsys)[0] == 0
    index_dir = Settings(collection=photos, artifacts=tmp_path / "a").image_index
    assert (index_dir / MANIFEST).is_file()
    images = ImageIndex.load(index_dir, shapes_model.bundle, collection_root=photos)
    images.set_search(exact_below=0)
    images.save()
    images.close()

    code, out, err = fragsearch(["search", "a red circle", "--k", "4", *common], capsys)
    assert code == 0, err
    lines = [line.split("\t") for line in out.splitlines()]
    assert len(lines) == 4 and all(Path(p).is_file() and Path(p).is_relative_to(photos) for *_, p in lines)
    code, paths, _ = fragsearch(["search", "a red circle", "--k", "4", "-f", *common], capsys)
    assert code == 0 and paths.splitlines() == [p for *_, p in lines]  # the same ranking, paths only
    code, answer, _ = fragsearch(["search", "a red circle", "--k", "2", "--json", *common], capsys)
    found = json.loads(answer)
    assert code == 0 and [r["file"] for r in found["results"]] == [p for *_, p in lines[:2]]
    assert all(r["alignment"] and r["path"] for r in found["results"])

    code, _, err = fragsearch(["search", "the", *common], capsys)  # nothing to embed: a clear refusal
    assert code == 2 and "fragsearch:" in err
    code, _, err = fragsearch(["search", "a red circle", "--collection", str(tmp_path / "none"),
                               "--artifacts", str(tmp_path / "a")], capsys)
    assert code == 4 and "fragsearch index" in err  # no index: exit status 4 (tests/test_cli_errors.py)


def test_a_cut_off_nothing_reaches_says_so(service_env: ServiceEnv, calibrated_checkpoint: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str], clean: Path) -> None:
    """--min-relevance 1.0: no result, the reason on stderr, exit status 1 (as grep's when nothing matches);
    0 keeps the k best, each with its relevance."""
    common = ["--model-path", str(calibrated_checkpoint), "--image-index", str(service_env.root / "images"),
              "--data", str(service_env.shapes.data), "--index-backend", service_env.settings.index_backend]
    code, out, err = fragsearch(["search", "a red circle beside a blue square", "--min-relevance", "1.0", *common],
                                capsys)
    assert code == 1 and out == "" and err.startswith("no good match")
    code, out, _ = fragsearch(["search", "a red circle beside a blue square", "--min-relevance", "0", "--k", "3",
                               *common], capsys)
    assert code == 0 and len(out.splitlines()) == 3
    assert all(0.0 <= float(line.split("\t")[0]) <= 1.0 for line in out.splitlines())

    upload = tmp_path / "photo.jpg"
    upload.write_bytes(service_env.jpeg())
    code, out, err = fragsearch(["annotate", str(upload), "--k", "3", "--sentence-index",
                                 str(service_env.root / "sentences"), *common], capsys)
    assert code == 0 and len(out.splitlines()) == 3, err
    code, _, err = fragsearch(["annotate", str(tmp_path / "missing.jpg"), "--sentence-index",
                               str(service_env.root / "sentences"), *common], capsys)
    assert code == 2 and "cannot read" in err


def test_the_settings_file_reaches_fragsearch_index(shapes_model: ShapesModel, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str], clean: Path) -> None:
    """`exclude`, `collection`, `cache` and `model_path` in fragsearch.toml are read by `fragsearch index` (the
    service reads the same file, so its next start does not undo the index run); a `variant` there names the
    model every command then looks for."""
    photos = tmp_path / "Pictures"
    for n, rel in enumerate(["a.jpg", "b.jpg", "Screenshots/s1.jpg", "Screenshots/s2.jpg"]):
        picture(photos / rel, 60 + n)
    artifacts = tmp_path / "artifacts"
    (clean / "fragsearch.toml").write_text(
        f'collection = "{photos}"\nexclude = ["Screenshots/"]\nartifacts = "{artifacts}"\n'
        f'cache = "{shapes_model.cache}"\nmodel_path = "{shapes_model.model_path}"\nworkers = 1\n')
    assert fragsearch(["index"], capsys)[0] == 0
    settings = Settings()
    assert settings.collection == photos.resolve() and settings.image_index.is_relative_to(artifacts)
    manifest = json.loads((settings.image_index / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["a.jpg", "b.jpg"], "the file's exclude left the screenshots out"

    (clean / "fragsearch.toml").write_text(f'collection = "{photos}"\nartifacts = "{artifacts}"\nvariant = "mine"\n')
    code, _, err = fragsearch(["index"], capsys)
    assert code == 2 and str(artifacts / "models" / "mine" / "model.pt") in err
    code, _, err = fragsearch(["index", "--varient", "x"], capsys)
    assert code == 2 and "--varient" in err
    (clean / "fragsearch.toml").write_text('exlude = ["x"]\n')  # a typo is an error, not ignored
    code, _, err = fragsearch(["index", str(photos)], capsys)
    assert code == 2 and "exlude" in err


def test_an_index_of_another_model_is_built_anew(shapes_model: ShapesModel, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str], clean: Path) -> None:
    """After a new release (another model fingerprint), `fragsearch index` sets the folder's index aside and
    builds it anew, as the service's start does, rather than failing on it."""
    from fragsearch.index.catalogue import built_fingerprint
    from fragsearch.index.fingerprint import model_fingerprint
    from fragsearch.model.bundle import Bundle
    from fragsearch.training.calibrate import fit_calibration

    photos = tmp_path / "Pictures"
    for n in range(3):
        picture(photos / f"p{n}.jpg", 70 + n)
    local = Bundle.load(shapes_model.model_path)
    local.calibration = fit_calibration(local, shapes_model.dev, refs=10, seed=0).localised(3, 0.75)
    other = local.save(tmp_path / "other-model")
    common = ["--artifacts", str(tmp_path / "a"), "--cache", str(shapes_model.cache), "--workers", "1"]
    assert fragsearch(["index", str(photos), "--model-path", str(shapes_model.model_path), *common], capsys)[0] == 0
    index_dir = Settings(collection=photos, artifacts=tmp_path / "a").image_index
    assert built_fingerprint(index_dir) == model_fingerprint(shapes_model.bundle)
    code, _, err = fragsearch(["index", str(photos), "--model-path", str(other), *common], capsys)
    assert code == 0, err
    new = model_fingerprint(Bundle.load(other))
    assert built_fingerprint(index_dir) == new != model_fingerprint(shapes_model.bundle)
    assert index_dir.with_name(index_dir.name + ".stale").is_dir(), "the earlier index set aside, not deleted"
    images = ImageIndex.load(index_dir, Bundle.load(other), collection_root=photos)
    assert len(images) == 3
    images.close()


def test_flags_over_the_environment_over_the_file(clean: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (clean / "fragsearch.toml").write_text('variant = "from-file"\nport = 8100\n')
    assert from_environment().variant == "from-file" and from_environment().port == 8100
    monkeypatch.setenv("FRAGSEARCH_VARIANT", "from-env")
    assert from_environment().variant == "from-env"
    assert Settings(variant="from-flag").variant == "from-flag"  # a flag's value, as settings_of gives it
    other = clean / "other.toml"
    other.write_text('variant = "named"\n')
    monkeypatch.delenv("FRAGSEARCH_VARIANT")
    monkeypatch.setenv("FRAGSEARCH_CONFIG", str(other))
    assert from_environment().variant == "named" and from_environment().port == 8000


def reads_of_settings_variables(path: Path) -> list[int]:
    """Lines of `path` that read a FRAGSEARCH_* environment variable (os.environ.get / [] / os.getenv)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and node.func.attr in ("get", "getenv", "pop", "setdefault") \
                and ast.unparse(node.func.value) in ("os.environ", "os", "environ"):
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ") \
                and isinstance(node.ctx, ast.Load):
            key = node.slice
        named = isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("FRAGSEARCH_")
        if named or isinstance(key, ast.JoinedStr) and ast.unparse(key).startswith("f'FRAGSEARCH_"):
            found.append(node.lineno)
    return found


def test_the_reader_finds_every_form(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('import os\na = os.environ.get("FRAGSEARCH_DATA")\nb = os.environ["FRAGSEARCH_X"]\n'
                      'c = os.getenv("FRAGSEARCH_Y", "")\nd = os.environ.get("HOME")\n'
                      'os.environ["FRAGSEARCH_Z"] = "1"\n')
    assert reads_of_settings_variables(sample) == [2, 3, 4]


def test_no_module_but_the_settings_reads_a_fragsearch_variable() -> None:
    readers = {str(p.relative_to(ROOT)): lines for package in PRODUCT for p in sorted((ROOT / package).rglob("*.py"))
               if (lines := reads_of_settings_variables(p))}
    assert set(readers) == {"fragsearch/settings.py"}, readers
