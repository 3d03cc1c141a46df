"""The package's layers, read from the source's AST (no import runs): the runtime never imports
the lab, no two files import each other round a cycle, and size limits hold."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "streamrl"
ABOVE_BOTH = ("streamrl.commands", "streamrl.cli")  # the CLI may import runtime and lab alike


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every streamrl module ``path`` imports, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "streamrl":
            for alias in node.names:  # `from streamrl.x import y` names module x.y when y is one
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "streamrl")
    return found


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_runtime_never_imports_the_lab():
    modules = _modules()
    offenders = {name: sorted(t for t in _imports(path, modules) if _within(t, ("streamrl.lab",)))
                 for name, path in modules.items() if not _within(name, ("streamrl.lab", *ABOVE_BOTH))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_import_cycle_between_files():
    modules = _modules()
    graph = {name: {t for t in _imports(path, modules) if t in modules and t != name} for name, path in modules.items()}
    # A package's __init__ is imported on the way to any of its modules; only real edges count.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_layer_check_sees_a_forbidden_import(tmp_path):
    """The check itself: a runtime file importing the lab (inside a function) is found."""
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from streamrl.lab.sim import engine\n")
    assert _imports(bad, {"streamrl.lab.sim.engine": bad}) == {"streamrl.lab.sim.engine"}


def test_no_file_over_550_lines_and_no_function_over_80():
    """In the package and in its tests."""
    long_files, long_functions = [], []
    for path in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.parent.joinpath("tests").rglob("*.py")]):
        text, name = path.read_text(), str(path.relative_to(PACKAGE.parent))
        if len(text.splitlines()) > 550:
            long_files.append(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{name} {node.name}")
    assert (long_files, long_functions) == ([], [])
