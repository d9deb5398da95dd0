"""The package's layering stays true: no import cycle between modules nor between packages (the
packages form a DAG: each imports only packages below it), and the engine layers never import
the server (the engine must run without the server's dependencies)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "pipepool"
# Front ends: they may import anything below them; nothing below imports them.
FRONT_ENDS = ("pipepool.server", "pipepool.commands", "pipepool.commands.cli", "pipepool.__main__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every pipepool module ``path`` imports, at module level or inside functions (a lazy
    import is still a dependency), except under ``if TYPE_CHECKING:``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    graph = {_module_name(f): _imports(f, modules) for f in files}
    # A package's __init__ importing its own submodules is how a package exports: not a
    # dependency of those submodules on the package.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not (name.startswith(d + ".") and d != name)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_import_graph_sees_the_package():
    graph = _graph()
    assert "pipepool.api.engine" in graph["pipepool.server.front"]
    assert "pipepool.driver.pipeline" in graph["pipepool.api.engine"]


def test_no_module_import_cycle():
    assert _cycles(_graph()) == []


def _package(module: str) -> str:
    """The top-level package (``pipepool.driver``) or module (``pipepool.config``) of
    ``module``."""
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for name, deps in graph.items():
        packages.setdefault(_package(name), set()).update(
            _package(d) for d in deps if _package(d) != _package(name)
        )
    return packages


def test_no_package_import_cycle():
    packages = _package_graph(_graph())
    cycles = _cycles(packages)
    graph = _graph()
    why = [
        f"{name} -> {dep}"
        for cycle in cycles
        for name, deps in graph.items()
        for dep in deps
        if _package(name) in cycle and _package(dep) in cycle and _package(name) != _package(dep)
    ]
    assert cycles == [], why


def test_the_package_graph_sees_the_layers():
    packages = _package_graph(_graph())
    assert "pipepool.core" in packages["pipepool.driver"]
    assert "pipepool.driver" in packages["pipepool.replicas"]
    assert "pipepool.loading" in packages["pipepool.stage"]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_engine_layers_never_import_a_front_end(front_end):
    graph = _graph()
    offenders = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if not name.startswith(FRONT_ENDS)
        for dep in deps
        if dep == front_end or dep.startswith(front_end + ".")
    )
    assert offenders == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
