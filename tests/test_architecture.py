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
