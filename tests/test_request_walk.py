"""The walk of a read request through the floors: the engine makes one call into an index per read
request and no service code runs inside it (the index makes its query fragments itself, with
model/embed.py); the engine calls the model only to decode an upload, before the index call.

Traced with sys.setprofile while the engine method runs: every function of model/, index/ or
service/ that is entered, as a call tree (other code is looked through).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import pytest

from fragsearch.model.embed import EmbeddedSentence

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

ROOT = str(Path(__file__).resolve().parent.parent) + "/"
FLOORS = ("model/", "index/", "service/")


@dataclass
class Call:
    file: str
    name: str
    calls: list[Call] = field(default_factory=list)

    @property
    def floor(self) -> str:
        return self.file.split("/")[0]


def trace(fn: Callable[..., Any], *args: Any) -> Call:
    """The product call tree of fn(*args), rooted at fn."""
    root = Call("", "")
    stack = [root]

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event not in ("call", "return") or not frame.f_code.co_filename.startswith(ROOT):
            return
        file = frame.f_code.co_filename[len(ROOT):].removeprefix("fragsearch/")  # imported through fragsearch/'s links
        if not file.startswith(FLOORS):
            return
        if event == "call":
            call = Call(file, frame.f_code.co_qualname)
            stack[-1].calls.append(call)
            stack.append(call)
        elif len(stack) > 1 and (stack[-1].file, stack[-1].name) == (file, frame.f_code.co_qualname):
            stack.pop()

    sys.setprofile(hook)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    assert len(root.calls) == 1 and root.calls[0].floor == "service"
    return root.calls[0]


def floors_inside(call: Call) -> set[str]:
    return {call.floor} | {f for c in call.calls for f in floors_inside(c)}


def engine_steps(call: Call) -> tuple[list[Call], list[Call]]:
    """What the engine's own code (service/) calls below it: (index calls, model calls)."""
    index: list[Call] = []
    model: list[Call] = []
    for c in call.calls:
        if c.floor == "index":
            index.append(c)
        elif c.floor == "model":
            model.append(c)
        else:
            more = engine_steps(c)
            index += more[0]
            model += more[1]
    return index, model


def test_the_tracer_sees_a_climb_back_to_the_service(service_env: ServiceEnv) -> None:
    """A read written the old way (encode, then rank: two index calls with the engine between them)
    is seen as such."""
    from fragsearch.model.embed import embed_sentence

    engine = service_env.engine

    def two_steps(sentence: str) -> None:
        sent, triplets = embed_sentence(engine.bundle, sentence)
        engine.images.search(EmbeddedSentence(sent, triplets), 3, 0)

    two_steps.__code__ = two_steps.__code__.replace(co_filename=ROOT + "service/engine.py")
    index, model = engine_steps(trace(two_steps, "a red circle"))
    assert [c.file for c in model] == ["model/embed.py"] and [c.file for c in index] == ["index/images.py"]


@pytest.mark.parametrize("read", ["search_images", "explain", "search_fragments", "search_triplet", "annotate",
                                  "similar_to_upload", "similar_to_image", "duplicates"])
def test_a_read_request_makes_one_index_call_and_never_returns_to_the_service(service_env: ServiceEnv,
                                                                             read: str) -> None:
    engine = service_env.engine
    sentence = service_env.captions[service_env.dev[0]][0]
    image_id = int(engine.images.ids()[0])
    args: dict[str, tuple[Any, ...]] = {
        "search_images": (sentence, 5), "explain": (image_id, sentence), "search_fragments": ("red circle", 5),
        "search_triplet": ("amod", "circle", "red", 5), "annotate": (service_env.jpeg(), 5),
        "similar_to_upload": (service_env.jpeg(), 5), "similar_to_image": (image_id, 5),
        "duplicates": (image_id, 0.9)}
    call = trace(getattr(engine, read), *args[read])
    index, model = engine_steps(call)
    assert len(index) == 1, [f"{c.file}:{c.name}" for c in index]
    assert "service" not in floors_inside(index[0]), f"{index[0].name} runs service code"
    uploads = read in ("annotate", "similar_to_upload")
    assert [c.file for c in model] == (["model/features.py"] if uploads else []), [c.name for c in model]
