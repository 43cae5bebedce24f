"""Imports inside dflash2 run one way: no module imports, directly or through others, a module that imports it.

Every import counts, at module level (TYPE_CHECKING blocks included) and inside functions: a function-level import
that closes a cycle only hides it until the function runs. A package's `__init__` running before its submodules is
not an edge of its own (it would make every package that re-exports a submodule look cyclic).
"""

from __future__ import annotations

import ast
from pathlib import Path

DFLASH2 = Path(__file__).resolve().parents[1] / "dflash2"

Graph = dict[str, dict[str, str]]  # module -> {imported module: "file:line" of the import}


def module_names(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at `package` (a folder with __init__.py)."""
    names = {}
    for file in sorted(package.rglob("*.py")):
        parts = file.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return names


def import_graph(package: Path) -> Graph:
    """Which of the package's modules each of its modules imports, wherever the import stands."""
    modules = module_names(package)

    def known(name: str) -> str | None:  # the module itself, or the package it is an attribute of
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: Graph = {}
    for name, file in modules.items():
        edges = graph.setdefault(name, {})
        here = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: `from . import x`, `from ..a import b`
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import sub` imports the submodule; `from mod import name` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in filter(None, map(known, targets)):
                if target != name:
                    edges.setdefault(target, f"{file.relative_to(package.parent)}:{node.lineno}")
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None when it has none (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it was walked
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def describe(cycle: list[str], graph: Graph) -> str:
    steps = zip(cycle, cycle[1:], strict=False)
    return "import cycle:\n" + "\n".join(f"  {a} -> {b}  ({graph[a][b]})" for a, b in steps)


def test_dflash2_has_no_import_cycle():
    graph = import_graph(DFLASH2)
    assert len(graph) > 30 and graph["dflash2.training.module"]  # the walk did read the package
    cycle = find_cycle(graph)
    if cycle:
        print(describe(cycle, graph))
    assert cycle is None, describe(cycle, graph)


def test_a_cycle_through_a_function_level_or_relative_import_is_found(tmp_path):
    """The check itself: a cycle closed inside a function, or through a relative import, does not slip past it."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import f\n")
    (package / "a.py").write_text("from pkg.sub import b\n\ndef f():\n    return b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def g():\n    from pkg import c\n    return c\n")
    (package / "c.py").write_text("x = 1\n")
    graph = import_graph(package)
    assert find_cycle(graph) is None  # __init__ importing a is no cycle with a's own `pkg.sub` import
    (package / "c.py").write_text("from .a import f\n")
    assert find_cycle(graph := import_graph(package)) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"], graph
