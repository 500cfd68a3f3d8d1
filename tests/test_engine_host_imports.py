"""engine_host's imports, read from its source (no module is executed): it imports nothing
from ``control`` (the control plane depends on the engine host, never the reverse), and its
modules import one another without a circle (imports inside functions count too: they
close a circle as soon as they run)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "engine_host"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from X import y`` gives X and X.y:
    y may be a submodule), wherever the import statement stands."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: engine_host modules it imports}``; importing a submodule also runs its
    packages' ``__init__``, so those count as imported too."""
    files = {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        for imp in _imports(path):
            parts = imp.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in files and target != mod:
                    deps.add(target)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_engine_host_imports_nothing_from_control():
    upward = {
        _module_name(p): sorted(i for i in _imports(p) if i == "control" or i.startswith("control."))
        for p in (ROOT / PACKAGE).rglob("*.py")
    }
    assert {m: i for m, i in upward.items() if i} == {}


def test_engine_host_modules_import_one_another_without_a_circle():
    graph = import_graph()
    assert "engine_host.router.front" in graph and "engine_host.plugin" in graph  # the files were found
    assert cycles(graph) == []


def test_the_circle_finder_finds_the_circle_through_the_endpoint_plugin():
    # the shape before the router became a package: plugin -> front -> router -> launcher -> plugin
    graph = {
        "plugin": {"front"},
        "front": {"router"},
        "router": {"launcher", "routing"},
        "launcher": {"plugin"},
        "routing": set(),
    }
    assert cycles(graph) == [["front", "launcher", "plugin", "router"]]
