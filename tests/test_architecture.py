"""The layout's rules, checked on the source: no module of tiertune (or benchmark) reads another module's
private attributes or imports its private names; each part of the engine stays small."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tiertune"


def _private_names(tree: ast.AST) -> set[str]:
    """The private attributes a file defines: ``self._x = ...`` and methods ``_x`` of its classes."""
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
        if isinstance(node, ast.ClassDef):
            names |= {f.name for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _violations(files: list[Path], root: Path = ROOT) -> list[str]:
    trees = {p: ast.parse(p.read_text()) for p in files}
    own = {p: _private_names(t) for p, t in trees.items()}
    everywhere = set().union(*own.values())
    found = []
    for path, tree in trees.items():
        where = path.relative_to(root)
        for node in ast.walk(tree):
            mine = (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            )
            if isinstance(node, ast.Attribute) and node.attr in everywhere - own[path] and not mine:
                found.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tiertune"):
                last = (node.module or "").rsplit(".", 1)[-1]
                for alias in node.names:
                    # the Triton kernels live in private modules imported lazily by their public op
                    if alias.name.startswith("_") and not last.startswith("_triton"):
                        found.append(f"{where}:{node.lineno} imports {node.module}.{alias.name}")
    return found


def test_no_module_reads_another_modules_private_attributes():
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(files) > 50
    assert _violations(files) == []


def test_the_check_finds_a_private_read(tmp_path):
    (tmp_path / "a.py").write_text("class A:\n    def __init__(self):\n        self._secret = 1\n")
    (tmp_path / "b.py").write_text("def peek(a):\n    return a._secret\n")
    assert _violations([tmp_path / "a.py", tmp_path / "b.py"], tmp_path) == ["b.py:2 reads a._secret"]


def test_the_engine_is_in_parts_of_a_few_hundred_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "engine").glob("*.py")}
    assert len(sizes) >= 8 and max(sizes.values()) <= 450, sizes


LAYERS = {
    "cli": 0,
    "export": 1,
    "estimates": 1,
    "finetune": 2,
    "config": 3,
    "formats": 3,
    "engine": 4,
    "loading": 5,
    "methods": 5,
    "quant": 6,
    "kernels": 6,
    "distributed": 6,
    "offload": 7,
}
LEAVES = {"errors", "units", "settings", "files", "logs", "structure"}  # tiertune/*.py that any layer may use


def _layer_violations(root: Path) -> list[str]:
    """Imports that point up the package layers (``LAYERS``: cli; export and estimate; finetune, the run;
    config, the recipe and its resolved plan; engine; loading and methods; quant, kernels and distributed;
    offload; then the leaf modules), or across two packages of one layer. Imports under ``if
    TYPE_CHECKING:`` are annotations only and are not counted here (``_circles`` counts them)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) == 1:
            continue  # tiertune/__init__.py (the API, imports lazily) and the leaves
        source = parts[0]
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if not name.startswith("tiertune."):
                    continue
                target = name.split(".")[1]
                if target == source or target in LEAVES:
                    continue
                if target not in LAYERS or LAYERS[target] <= LAYERS[source]:
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    return found


def test_imports_point_down_the_layers():
    assert _layer_violations(PACKAGE) == []


def test_the_layer_check_finds_an_upward_import(tmp_path):
    (tmp_path / "offload").mkdir()
    (tmp_path / "offload" / "store.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tiertune.engine import x\n"
        "from tiertune.engine.trainer import StreamedTrainer\n"
    )
    assert _layer_violations(tmp_path) == ["offload/store.py:4 imports tiertune.engine.trainer"]


def _mode_checks(files: list[Path], root: Path = ROOT) -> list[str]:
    """Where code asks which sharding it holds (``x is None`` / ``x is not None`` of a name or attribute called
    ``zero``, or ``isinstance(x, Zero | Local)``) instead of calling the one it holds."""
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops):
                names = [node.left, *node.comparators]
                if any(getattr(n, "id", getattr(n, "attr", None)) == "zero" for n in names):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
            asks = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
            if (
                asks
                and len(node.args) == 2
                and any(n in ast.unparse(node.args[1]) for n in ("Zero", "Local"))
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_one_process_and_one_rank_of_several_run_the_same_code():
    # the trainer holds a sharding (engine.sharding: Local or Zero) and calls it; nobody asks which one
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    assert _mode_checks(files) == []


def test_the_mode_check_finds_a_branch_on_the_sharding(tmp_path):
    (tmp_path / "a.py").write_text(
        "def f(t):\n    if t.zero is None:\n        return 1\n    return isinstance(t, Zero)\n"
    )
    assert _mode_checks([tmp_path / "a.py"], tmp_path) == [
        "a.py:2 t.zero is None",
        "a.py:4 isinstance(t, Zero)",
    ]


def _trainer_reads(files: list[Path], root: Path = ROOT) -> list[str]:
    """Where code outside engine/ reads what the trainer holds inside: its store, its sharding or its states
    (attributes so named of a name or attribute called ``trainer``/``_trainer``)."""
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("store", "sharding", "states"):
                owner = getattr(node.value, "id", getattr(node.value, "attr", None))
                if owner in ("trainer", "_trainer"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return sorted(found)


def test_nothing_outside_the_engine_reads_the_trainers_store_sharding_or_states():
    # the run, the checkpoint and the benchmarks ask the trainer (store_stats, chunk_sizes, state_parts, ...)
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if "engine" not in p.relative_to(PACKAGE).parts]
    assert _trainer_reads(files + sorted((ROOT / "benchmarks").glob("*.py"))) == []


def test_the_trainer_check_finds_a_read_of_its_store(tmp_path):
    (tmp_path / "a.py").write_text("def f(self):\n    return self._trainer.store.stats(), trainer.states\n")
    assert _trainer_reads([tmp_path / "a.py"], tmp_path) == [
        "a.py:2 self._trainer.store",
        "a.py:2 trainer.states",
    ]


def _module_imports(root: Path) -> dict[str, set[str]]:
    """Each module of the package under ``root`` (dotted, from ``root``'s name) -> the package's modules it
    imports: anywhere in the file (at the top, inside functions, under ``if TYPE_CHECKING:``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:  # a name imported from a module: the module
                    name = name.rpartition(".")[0]
                if name and name != module and name != root.name:
                    graph[module].add(name)
    return graph


def _circles(root: Path) -> list[list[str]]:
    """The package's import circles: each set of modules (sorted) that import one another round, counting
    every import (``_module_imports``)."""
    graph = _module_imports(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            circle = []
            while True:
                w = stack.pop()
                circle.append(w)
                if w == v:
                    break
            if len(circle) > 1:
                found.append(sorted(circle))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle_in_the_package():
    # imports inside functions and under TYPE_CHECKING count: a circle there is a design knot all the same
    assert len(_module_imports(PACKAGE)) > 90
    assert _circles(PACKAGE) == []


def test_the_circle_check_finds_one_through_a_function_and_type_checking(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def f():\n    from pkg.sub.b import g\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import c\n"
    )
    (package / "sub" / "c.py").write_text("from pkg.sub.a import f\nfrom pkg import sub\n")
    (package / "d.py").write_text("from pkg.sub.a import f\n")
    assert _circles(package) == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.c"]]


def test_no_package_shadows_a_name_of_the_api():
    # a subpackage named like an API function (``tiertune/estimate/`` beside ``tiertune.estimate()``) replaces
    # the function on the package once anything imports it: every module imported first, then each name
    import importlib
    import pkgutil
    import types

    import tiertune

    for info in pkgutil.walk_packages(tiertune.__path__, "tiertune."):
        if "_triton" not in info.name and not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    for name in tiertune.__all__:
        assert not isinstance(getattr(tiertune, name), types.ModuleType), name
