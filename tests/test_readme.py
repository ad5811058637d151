"""The README's `curl` examples and the API page's, run as written (by curl, through bash) against the
service on a real socket, and each answer checked for the shape the page shows.

The examples are the ```bash blocks that start with `curl`, each followed by a ```json block (the
answer, trimmed from a real one of the served model on Flickr8K), of the README (the main routes)
and then of docs/api/index.md (the others: more like this, /explain, add, duplicates, delete). Here the service serves
the synthetic shapes collection (tests/conftest_service.py), whose model knows circles and squares,
not dogs: each sentence of the README is replaced by one in that vocabulary (TEXTS; an example with
a sentence missing there fails), uploads (`-F file=@name.jpg`) are shapes images written under that
name, and the id the README's add example answers is replaced by the one the service gave. What is
checked: every key the README shows is in the answer, with a value of the same JSON type, down to
the first item of every list; a bare value (a status code) must be equal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fragsearch.service.app import create_app
from tests.uvicorn_thread import uvicorn_server

if TYPE_CHECKING:
    from fragsearch.model.bundle import Bundle
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API_PAGE = ROOT / "docs" / "api" / "index.md"
EXAMPLE_PAGES = (README, API_PAGE)  # in this order: the add example's id is used by the pages after it
CURL = shutil.which("curl")
# skipped without curl, but failed under CI (.ci/run installs it): the README's examples must run there
pytestmark = pytest.mark.required(CURL is not None, reason="curl is absent (apt-get install curl)")

# the README's sentences and phrases → the shapes model's vocabulary
TEXTS = {
    "a dog runs through the grass": "a red circle beside a blue square",
    "black dog": "red circle",
    "a black dog catches a ball": "a red circle beside a blue square",
}
HOST = re.compile(r"\b(?:localhost|127\.0\.0\.1):8000\b")
UPLOAD = re.compile(r"file=@([\w.-]+)")


def page_examples(page: Path) -> list[tuple[str, Any]]:
    """(command, answer shown) for every ```bash block starting with curl, with the ```json block after it."""
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", page.read_text(), flags=re.M | re.S)
    out = []
    for (lang, body), (next_lang, answer) in zip(blocks, blocks[1:], strict=False):
        if lang == "bash" and body.lstrip().startswith("curl"):
            assert next_lang == "json", f"{page.name} shows no answer after {body.strip()!r}"
            out.append((body.strip(), json.loads(answer)))
    return out


def readme_examples() -> list[tuple[str, Any]]:
    """The README's examples, then the API page's."""
    return [example for page in EXAMPLE_PAGES for example in page_examples(page)]


def nullable_fields() -> frozenset[str]:
    """The names of the API's response fields that may be null (their type allows None in service/schemas.py):
    an answer may hold null where the README shows a value (a `box` of a thing not found)."""
    import types
    import typing

    from pydantic import BaseModel

    import fragsearch.service.schemas as schemas
    names = set()
    for model in vars(schemas).values():
        if isinstance(model, type) and issubclass(model, BaseModel):
            for name, info in model.model_fields.items():
                if info.annotation is None or type(None) in typing.get_args(info.annotation) or (
                        isinstance(info.annotation, types.UnionType) and type(None) in info.annotation.__args__):
                    names.add(name)
    return frozenset(names)


NULLABLE = nullable_fields()


def assert_same_shape(shown: Any, got: Any, where: str = "answer") -> None:
    """`got` has every key `shown` has, with values of the same JSON type (lists: their first items); a field
    the API documents as nullable may be null where the README shows a value."""
    if isinstance(shown, dict):
        assert isinstance(got, dict), f"{where}: {got!r} is not an object"
        for key, value in shown.items():
            assert key in got, f"{where}: no {key!r} in {sorted(got)}"
            if got[key] is None and key in NULLABLE:
                continue
            assert_same_shape(value, got[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(got, list), f"{where}: {got!r} is not a list"
        if shown:
            assert got, f"{where}: empty, the README shows items"
            assert_same_shape(shown[0], got[0], f"{where}[0]")
    elif shown is None:
        pass  # null in the README (next_offset on a last page): a number elsewhere
    elif isinstance(shown, bool):
        assert isinstance(got, bool), f"{where}: {got!r} is not true/false"
    elif isinstance(shown, int | float):
        assert isinstance(got, int | float) and not isinstance(got, bool), f"{where}: {got!r} is not a number"
    else:
        assert isinstance(got, type(shown)), f"{where}: {got!r} is not a {type(shown).__name__}"


def test_the_readme_and_the_api_page_have_an_example_of_every_route() -> None:
    commands = [command for command, _ in readme_examples()]
    for route in ("/search/images", "/annotate", "/search/fragments", "/search/similar", "/explain", "/images"):
        assert any(re.search(rf"8000{re.escape(route)}\b", c) for c in commands), route
    assert any("-X DELETE" in c for c in commands)
    in_readme = [command for command, _ in page_examples(README)]
    for route in ("/search/images", "/annotate"):  # the main routes are shown in the README itself
        assert any(re.search(rf"8000{re.escape(route)}\b", c) for c in in_readme), route


def test_the_shape_check_tells_a_renamed_field() -> None:
    assert_same_shape({"results": [{"id": 1, "box": [0.0]}]}, {"results": [{"id": 2, "box": [1.5], "x": 1}]})
    with pytest.raises(AssertionError, match="no 'id'"):
        assert_same_shape({"results": [{"id": 1}]}, {"results": [{"image_id": 2}]})
    with pytest.raises(AssertionError, match="not a number"):
        assert_same_shape({"score": 0.5}, {"score": "0.5"})
    # a box is null where the thing is not found (FragmentMatchOut.box); a score never is
    assert "box" in NULLABLE and "score" not in NULLABLE
    assert_same_shape({"alignment": [{"box": [0.0], "score": 1.0}]}, {"alignment": [{"box": None, "score": 2.0}]})
    with pytest.raises(AssertionError, match="not a number"):
        assert_same_shape({"score": 0.5}, {"score": None})


@pytest.mark.parametrize("service_env", ["faiss"], indirect=True)
def test_the_readme_curl_examples_answer_as_shown(service_env: ServiceEnv, evidence_bundle: Bundle,
                                                 tmp_path: Path) -> None:
    # the shapes model with its relevance scale and phrase evidence, as the README's model has: results carry a
    # relevance, and alignments say what is found
    settings, engine = service_env.writable(tmp_path, bundle=evidence_bundle)
    work = tmp_path / "cwd"
    work.mkdir()
    examples = readme_examples()
    assert len(examples) >= 7
    added: dict[str, str] = {}
    with uvicorn_server(create_app(settings, engine=engine)) as base:
        for command, shown in examples:
            run = HOST.sub(base.removeprefix("http://"), command)
            for text, replacement in TEXTS.items():
                run = run.replace(f'"{text}"', f'"{replacement}"')
            for shown_id, real_id in added.items():
                run = run.replace(f"/images/{shown_id}", f"/images/{real_id}")
            quoted = re.findall(r'"sentence": "([^"]+)"|"phrase": "([^"]+)"', run)
            unknown = [t for pair in quoted for t in pair if t and t not in TEXTS.values()]
            assert not unknown, f"add a shapes counterpart of {unknown} to TEXTS"
            for name in UPLOAD.findall(run):
                (work / name).write_bytes(service_env.jpeg())
            r = subprocess.run(["bash", "-c", run], cwd=work, capture_output=True, text=True, timeout=300,
                               env={**os.environ, "FRAGSEARCH_API_KEY": service_env.api_key})
            assert r.returncode == 0, (command, r.stderr)
            got = json.loads(r.stdout)
            if isinstance(shown, dict | list):
                assert_same_shape(shown, got)
            else:
                assert got == shown, (command, got)
            if re.search(r"8000/images\s", command + " ") and isinstance(shown, dict):  # the add example
                added[str(shown["id"])] = str(got["id"])
    assert added, "the README's add example ran"
    assert len(engine.images) == len(service_env.dev)  # the delete example removed what the add example added
