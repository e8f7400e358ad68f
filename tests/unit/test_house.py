"""The house's shape, from the code's own imports and folders (issue 30).

- No import circle between product modules (gateway, scheduler_svc, worker_svc, kernels, pagoda;
  generated pagoda/v1 aside). Every import statement counts, wherever it stands: module level,
  inside a function, under `if TYPE_CHECKING:` — a circle hidden in a function is still one.
  `import a.b.c` and `from a.b import c` name module a.b.c when it exists, else the package a.b
  (whose `__init__` runs: `from pkg import Class` is an edge to pkg). The parents that Python
  imports on the way (a, a.b for a.b.c) are not edges: a package `__init__` that imports nothing
  of its children, as most here, adds no circle.
- No product folder holds more than MAX_MODULES_PER_FOLDER .py files directly: past that it wants
  rooms.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("gateway", "scheduler_svc", "worker_svc", "kernels", "pagoda")
MAX_MODULES_PER_FOLDER = 20


def _product_files() -> Iterator[Path]:
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            if path.relative_to(ROOT).parts[:2] != ("pagoda", "v1"):  # generated protobuf code
                yield path


def _modules() -> dict[str, Path]:
    modules = {}
    for path in _product_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(p for p in parts if p != "__init__")] = path
    return modules


def _named_module(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific product module `name` names (`a.b.Class` names a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names += [f"{base}.{alias.name}" for alias in node.names]
    found = {_named_module(name, modules) for name in names}
    return {name for name in found if name is not None and name != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_imports_everywhere_they_stand():
    graph = import_graph()
    assert sum(map(len, graph.values())) > 500
    # function-level (worker_svc.__main__ picks the fake worker inside a function) and relative
    assert any(target.startswith("worker_svc.fake") for target in graph["worker_svc.__main__"])
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_between_product_modules():
    assert circles(import_graph()) == []


def test_no_product_folder_holds_more_than_twenty_modules():
    per_folder: dict[Path, int] = {}
    for path in _product_files():
        per_folder[path.parent] = per_folder.get(path.parent, 0) + 1
    crowded = {str(folder.relative_to(ROOT)): n for folder, n in per_folder.items()
               if n > MAX_MODULES_PER_FOLDER}
    assert crowded == {}


def test_the_grpc_front_end_does_not_import_the_openai_room():
    graph = import_graph()
    assert not [m for m in graph["gateway.grpc_api"] if m.startswith("gateway.openai")]
