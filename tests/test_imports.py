"""Imports inside dflash2 run one way: no module imports, directly or through others, a module that imports it, and
no package imports one above it in the layers (infrastructure < model < target < decoding < data < training < export
< evaluation < studies < commands; dflash2.testing sits with the target). Only dflash2.commands knows Hydra: no other
module imports hydra or omegaconf, so the library takes plain values and runs without a config.

Every import counts, at module level (TYPE_CHECKING blocks included), inside functions and in a module's
`if __name__ == "__main__":` block: a function-level import that closes a cycle only hides it until the function runs,
and a module run as a command (`python -m ...`) is imported a second time by whatever it imports that imports it. A
package's `__init__` running before its submodules is not an edge of its own (it would make every package that
re-exports a submodule look cyclic).
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


def imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it stands."""
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    return sorted(found, key=lambda node: node.lineno)


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
        for node in imports(ast.parse(file.read_text(), str(file))):
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


# The layers, low to high: a module imports its own layer's modules and lower ones only. A package's top folder names
# its layer; the infrastructure is flat; the package itself (dflash2/__init__.py) is the drafter's public API.
LAYERS = ("infrastructure", "model", "target", "decoding", "data", "training", "export", "evaluation", "studies",
          "commands")  # fmt: skip
INFRASTRUCTURE = {"cache", "downloads", "errors", "progress"}
FLAT = {"testing": "target"}  # the tiny random target of the tests, benchmarks and study rehearsals
HYDRA = ("hydra", "omegaconf")  # the config libraries, dflash2.commands' alone


def layer_of(module: str) -> int | None:
    """The layer of a module of the package (its index in LAYERS), None if none."""
    top = module.split(".")[1] if "." in module else None
    if top is None:
        return LAYERS.index("model")
    if top in INFRASTRUCTURE:
        return 0
    if top in FLAT:
        return LAYERS.index(FLAT[top])
    return LAYERS.index(top) if top in LAYERS else None


def upward_imports(graph: Graph) -> list[str]:
    """Every import of a higher layer's module by a lower layer's, as "file:line  importer -> imported"."""
    return [
        f"{where}  {a} -> {b}"
        for a, edges in sorted(graph.items())
        for b, where in sorted(edges.items(), key=lambda e: e[1])
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)
    ]


def test_dflash2_imports_run_down_the_layers():
    graph = import_graph(DFLASH2)
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (a package of LAYERS, or INFRASTRUCTURE): {unplaced}"
    upward = upward_imports(graph)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_an_upward_import_inside_a_function_or_a_main_block_is_found(tmp_path):
    """The check itself, on a small package of the same layout: a function-level import of a higher layer, and one in
    the module's `__main__` block (a data module handing over to its command), are reported with file and line."""
    package = tmp_path / "dflash2"
    for folder in ("data", "training", "commands"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "commands" / "features.py").write_text("from dflash2.data import features\n")
    (package / "training" / "run.py").write_text("from dflash2.data.features import write\n")
    (package / "data" / "features.py").write_text("def write():\n    return 1\n")
    assert upward_imports(import_graph(package)) == []
    (package / "data" / "features.py").write_text(
        "def write():\n    return 1\n\n\nif __name__ == '__main__':\n    from dflash2.commands import features\n"
    )
    assert upward_imports(import_graph(package)) == [
        "dflash2/data/features.py:6  dflash2.data.features -> dflash2.commands.features"
    ]
    (package / "data" / "features.py").write_text(
        "def write():\n    from dflash2.training.run import write\n\n    return write\n"
    )
    assert upward_imports(import_graph(package)) == [
        "dflash2/data/features.py:2  dflash2.data.features -> dflash2.training.run"
    ]


def hydra_imports(package: Path) -> list[str]:
    """Every import of hydra or omegaconf by a module outside the package's commands, as "file:line  module"."""
    found = []
    for name, file in module_names(package).items():
        if name == f"{package.name}.commands" or name.startswith(f"{package.name}.commands."):
            continue
        for node in imports(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: the package's own
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.split(".")[0] in HYDRA for n in names):
                found.append(f"{file.relative_to(package.parent)}:{node.lineno}  {', '.join(names)}")
    return found


def test_only_the_commands_import_hydra_or_omegaconf():
    found = hydra_imports(DFLASH2)
    assert not found, "hydra/omegaconf imported outside dflash2/commands/:\n" + "\n".join(found)


def test_a_hydra_import_outside_the_commands_is_found(tmp_path):
    """The check itself: a function-level `from omegaconf import ...` in a library module is reported; the same
    import in dflash2/commands/ is not."""
    package = tmp_path / "dflash2"
    for folder in ("training", "commands"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "commands" / "train.py").write_text("import hydra\nfrom omegaconf import DictConfig\n")
    (package / "training" / "run.py").write_text("def f():\n    from omegaconf import OmegaConf\n\n    return 1\n")
    assert hydra_imports(package) == ["dflash2/training/run.py:2  omegaconf"]
