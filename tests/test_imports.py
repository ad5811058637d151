"""The import graph: no module of model/ reaches back to one that imports it; no circle anywhere in the
product (model/, index/, service/, training/); the house direction service -> index -> model; and model/,
index/ and service/ never import training/ but through the one door that trains a missing model
(function-local and TYPE_CHECKING imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "model"
NAMESPACE = "fragsearch"  # the installed name of the product's folders: model/ is fragsearch.model
MODEL_PACKAGE = f"{NAMESPACE}.model"


def model_imports(path: Path) -> set[str]:
    """The model modules `path` imports anywhere in its body (as bare names: "bundle", "score")."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith(f"{MODEL_PACKAGE}."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith(f"{MODEL_PACKAGE}."):
                found.add(node.module.split(".")[2])
            elif node.module == MODEL_PACKAGE:
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
    (tmp_path / "a.py").write_text("from fragsearch.model.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from fragsearch.model import c\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    import fragsearch.model.a as a\n"
                                   "import model.b\n")  # the bare folder name is not the package
    graph = {p.stem: model_imports(p) for p in tmp_path.glob("*.py")}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert cycle(graph) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_two_modules_of_model_import_each_other() -> None:
    graph = import_graph()
    assert {"bundle", "calibration", "score", "variants"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_atomic_writes_go_through_the_one_helper() -> None:
    """A rename onto a target appears only in model/atomic.py (model, index and service)."""
    root = ROOT
    renames = [str(p.relative_to(root)) for package in ("model", "index", "service")
               for p in sorted((root / package).rglob("*.py")) if "os.replace(" in p.read_text()]
    assert renames == ["model/atomic.py"]


def test_pictures_are_read_at_the_models_side_by_the_one_reader() -> None:
    """The model's reading side (``decode_side``) meets a picture's bytes in model/features.py's PhotoReader
    only: no other module of the product or the benches both names the side and calls ``read_image`` or
    ``content_key``."""
    files = [p for package in ("model", "index", "service", "training", "bench")
             for p in sorted((ROOT / package).rglob("*.py")) if p.relative_to(ROOT).as_posix() != "model/features.py"]
    both = []
    for p in files:
        tree = ast.parse(p.read_text(), str(p))
        names = {getattr(n, "attr", getattr(n, "id", getattr(n, "arg", ""))) for n in ast.walk(tree)}
        calls = {getattr(n.func, "id", getattr(n.func, "attr", "")) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        if "decode_side" in names and calls & {"read_image", "content_key"}:
            both.append(str(p.relative_to(ROOT)))
    assert both == []


ATOMIC = {"atomic_file", "atomic_path", "cached_file", "fsync_dir", "stale_temps", "TMP_SUFFIX"}


def test_atomic_writes_are_imported_through_one_door() -> None:
    """Every module that names model/atomic.py's helpers takes them from model.atomic, none through another."""
    files = [p for package in ("model", "index", "service", "training") for p in sorted((ROOT / package).rglob("*.py"))]
    elsewhere = [f"{p.relative_to(ROOT)}: from {node.module}"
                 for p in files for node in ast.walk(ast.parse(p.read_text(), str(p)))
                 if isinstance(node, ast.ImportFrom) and node.module != "fragsearch.model.atomic"
                 and ATOMIC & {a.name for a in node.names}]
    assert elsewhere == []


def test_a_file_is_hashed_by_the_one_helper_without_a_read_loop() -> None:
    """A file's content hash is model.atomic.sha256_file (hashlib.file_digest): no loop of read() calls
    feeding a hash's update() in the code."""
    loops = []
    for package in ("model", "index", "service", "training", "bench", "tools"):
        for p in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                if isinstance(node, ast.While | ast.For):
                    calls = {c.func.attr for c in ast.walk(node)
                             if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)}
                    if {"read", "update"} <= calls:
                        loops.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert loops == []


def imports_of(package: str, path: Path) -> list[tuple[str, str | None]]:
    """The modules of `package` that `path` imports anywhere in its body, each with the function whose
    body imports it (None: at module level)."""
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, function) for a in child.names
                             if a.name == package or a.name.startswith(package + "."))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module == package:
                    found.extend((f"{package}.{a.name}", function) for a in child.names)
                elif child.module.startswith(package + "."):
                    found.append((child.module, function))
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), None)
    return found


def training_imports(*packages: str) -> dict[str, list[tuple[str, str | None]]]:
    """Per file of `packages` that imports training/: what it imports and where."""
    found = {str(p.relative_to(ROOT)): imports_of(f"{NAMESPACE}.training", p)
             for package in packages for p in sorted((ROOT / package).rglob("*.py"))}
    return {path: imports for path, imports in found.items() if imports}


def test_the_training_import_finder_sees_every_form(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import fragsearch.training.train\nfrom fragsearch.training import evaluate\n"
                                   "def f():\n    from fragsearch.training.calibrate import fit_calibration\n"
                                   "import fragsearch.trainingwheels\nfrom fragsearch.model.train import x\n")
    assert imports_of("fragsearch.training", tmp_path / "a.py") == [
        ("fragsearch.training.train", None), ("fragsearch.training.evaluate", None),
        ("fragsearch.training.calibrate", "f")]


def test_model_and_index_never_import_training() -> None:
    assert training_imports("model", "index") == {}


def test_service_imports_training_only_to_train_a_missing_model() -> None:
    """One door: service/prepare.py's ensure_model, inside the function (serving loads no training code)."""
    assert training_imports("service") == {"service/prepare.py": [("fragsearch.training.train", "ensure_model")]}


PRODUCT = ("model", "index", "service", "training")
FLOOR = {"model": 1, "index": 2, "service": 3}  # the house: service -> index -> model, no arrow up


def module_of(path: Path, root: Path) -> str:
    """The dotted module name of a file under `root` ("index/base.py" -> "fragsearch.index.base")."""
    parts = [NAMESPACE, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_graph(root: Path = ROOT, packages: tuple[str, ...] = PRODUCT) -> dict[str, set[str]]:
    """Module -> the product modules it imports anywhere in its body (function-local and TYPE_CHECKING
    imports included); `from package import name` is the submodule `name` when there is one."""
    modules = {module_of(p, root) for package in packages for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                                 for a in node.names)
            name = module_of(path, root)
            graph[name] = {m for m in found if m in modules} - {name}
    return graph


def test_the_product_graph_resolves_submodules_and_packages(tmp_path: Path) -> None:
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "__init__.py").write_text("from fragsearch.index.a import A\n")
    (tmp_path / "index" / "a.py").write_text("from fragsearch.index import b\nclass A: ...\n")
    (tmp_path / "index" / "b.py").write_text("def f():\n    from fragsearch.index import A\n")
    graph = product_graph(tmp_path, ("index",))
    ns = "fragsearch.index"
    assert graph == {ns: {f"{ns}.a"}, f"{ns}.a": {f"{ns}.b"}, f"{ns}.b": {ns}}
    assert cycle(graph) == [ns, f"{ns}.a", f"{ns}.b", ns]


def test_no_import_circles_in_the_product() -> None:
    """No file of model/, index/, service/ or training/ reaches back to one that imports it."""
    graph = product_graph()
    named = {f"{NAMESPACE}.{m}" for m in ("index.base", "index.candidates", "index.milvus", "service.engine")}
    assert named <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_the_house_direction_service_index_model() -> None:
    """model/ imports neither index/ nor service/, and index/ never imports service/ (training/ apart)."""
    up = sorted(f"{a} -> {b}" for a, targets in product_graph().items() for b in targets
                if a.split(".")[1] in FLOOR and b.split(".")[1] in FLOOR
                and FLOOR[b.split(".")[1]] > FLOOR[a.split(".")[1]])
    assert up == []


def test_the_product_is_imported_by_its_installed_name() -> None:
    """model/, index/, service/ and training/ are the packages fragsearch.model, fragsearch.index, ... (in a
    checkout through fragsearch/'s links to them, installed by pyproject.toml's packages): no file imports them
    by their folder's name, which would load a second copy of each module."""
    bare = sorted(f"{p.relative_to(ROOT)}:{node.lineno}"
                  for package in (*PRODUCT, NAMESPACE, "bench", "tools", "tests")
                  for p in sorted((ROOT / package).rglob("*.py"))
                  for node in ast.walk(ast.parse(p.read_text(), str(p)))
                  if (isinstance(node, ast.Import) and any(a.name.split(".")[0] in PRODUCT for a in node.names))
                  or (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                      and node.module.split(".")[0] in PRODUCT))
    assert bare == []
    assert all((ROOT / NAMESPACE / package).resolve() == ROOT / package for package in PRODUCT)
