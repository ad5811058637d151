"""The import graph of model/: no module reaches back to one that imports it (function-local and
TYPE_CHECKING imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

MODEL = Path(__file__).resolve().parent.parent / "model"


def model_imports(path: Path) -> set[str]:
    """The model modules `path` imports anywhere in its body (as bare names: "bundle", "score")."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("model."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("model."):
                found.add(node.module.split(".")[1])
            elif node.module == "model":
                found.update(a.name for a in node.names)
    return found - {path.stem}


def import_graph() -> dict[str, set[str]]:
    return {p.stem: model_imports(p) for p in sorted(MODEL.glob("*.py"))}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_local_import_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from model.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from model import c\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import model.a\n")
    graph = {p.stem: model_imports(p) for p in tmp_path.glob("*.py")}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert cycle(graph) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_two_modules_of_model_import_each_other() -> None:
    graph = import_graph()
    assert {"bundle", "calibrate", "calibration", "evaluate", "train"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_atomic_writes_go_through_the_one_helper() -> None:
    """A rename onto a target appears only in model/atomic.py (model, index and service)."""
    root = MODEL.parent
    renames = [str(p.relative_to(root)) for package in ("model", "index", "service")
               for p in sorted((root / package).rglob("*.py")) if "os.replace(" in p.read_text()]
    assert renames == ["model/atomic.py"]
