"""No import cycles anywhere in the tree: among the modules of every top-level package of the repository
(services/, benchmarks/, tests/, and any other folder with an __init__.py), within and across them (statically,
with `ast`; nothing is imported).

What counts as an import of module A by module B:
- `import steploop.x.y` and `from steploop.x import y` (y a submodule: steploop.x.y; else the package steploop.x),
  absolute or relative (`from . import y`, `from ..common import z`), wherever they are in B: at module level, and
  also inside functions and methods. A lazy import defers a cycle to run time, it does not remove it: the two
  modules still cannot be understood, tested or split apart one without the other (the attention backends' factory
  imported them inside a function).
- Not counted: imports under `if TYPE_CHECKING:` (annotations only, no run-time dependency), and anything outside
  the repository's packages (third-party and the standard library cannot close a cycle through them).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the repository's top-level packages (a new one, e.g. an import package for the wheel, is walked too)
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
# a folder whose import name differs: services/ installs as the package `steploop` (setup.py's package_dir)
IMPORT_NAME = {"services": "steploop"}
ROOTS = {IMPORT_NAME.get(p, p) for p in PACKAGES}   # the top-level import names of those folders


def module_names() -> dict[str, pathlib.Path]:
    """Every module of the repository's packages, by dotted name (a package is named by its __init__.py)."""
    out = {}
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        parts[0] = IMPORT_NAME.get(parts[0], parts[0])
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Import statements anywhere in the tree except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        stack.extend(children)


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The repository's modules that module `name` imports (see the module docstring for what counts)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:   # `import a.b.c` of a name inside a module: that module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ROOTS:
                    add(alias.name)
            continue
        if node.level:   # relative: from the module's package, one level up per extra dot
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] not in ROOTS:
            continue
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            add(submodule if submodule in modules else source)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """(one cycle a -> b -> ... -> a, every module of its component) per strongly connected component of more
    than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [(_cycle_in(sorted(c)[0], c, graph), sorted(c)) for c in components]


def _cycle_in(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside the component (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start}")   # unreachable for a strongly connected component


def test_the_walk_sees_relative_function_level_and_type_checking_imports(tmp_path):
    modules = {"steploop.a": tmp_path / "a.py", "steploop.b": tmp_path / "b.py", "steploop.c": tmp_path / "c.py",
               "steploop": tmp_path / "__init__.py"}
    modules["steploop.a"].write_text(
        "from typing import TYPE_CHECKING\nimport os\nfrom . import b\n"
        "if TYPE_CHECKING:\n    from steploop.c import C\n"
        "def f():\n    from steploop.c import g\n")
    assert imports_of("steploop.a", modules["steploop.a"], modules) == {"steploop.b", "steploop.c"}
    modules["steploop.b"].write_text("import os\n")
    modules["steploop.c"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import steploop.a\n")
    assert imports_of("steploop.c", modules["steploop.c"], modules) == set()
    assert find_cycles({"x": {"y"}, "y": {"z", "x"}, "z": {"x"}, "w": {"x"}}) == [(["x", "y", "x"], ["x", "y", "z"])]
    assert find_cycles({"x": {"y"}, "y": set()}) == []


def test_no_import_cycles_anywhere_in_the_tree():
    graph = import_graph()
    assert {"services", "benchmarks", "tests"} <= set(PACKAGES), PACKAGES
    assert len(graph) > 100 and graph["steploop.gateway.app"], "the walk found no modules or no imports"
    assert "tests.integration.cluster" in graph["benchmarks.cpu_peers"], "the walk does not follow benchmarks/"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among the repository's modules:\n" + "\n".join(
        " -> ".join(cycle) + (f"  (one group: {', '.join(members)})" if len(members) > 2 else "")
        for cycle, members in cycles)
