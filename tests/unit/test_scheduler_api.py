"""The Scheduler's shape (issue 30): one class, no mixins, its whole public API declared in
scheduler.py; its features are objects it holds. And scheduler_svc imports without a circle, counting
every import (module level, in functions, under `if TYPE_CHECKING:`)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from scheduler_svc.core import scheduler as scheduler_module
from scheduler_svc.core.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[2]


def test_the_scheduler_is_one_class_without_mixins():
    assert Scheduler.__mro__ == (Scheduler, object)


def test_every_public_method_and_property_is_declared_in_scheduler_py():
    public = [name for name in dir(Scheduler) if not name.startswith("_")]
    assert {"schedule", "update", "add_request", "abort", "stats", "check_invariants"} <= set(public)
    for name in public:
        assert name in Scheduler.__dict__, f"Scheduler.{name} is inherited, not declared"
        member = Scheduler.__dict__[name]
        func = member.fget if isinstance(member, property) else member
        assert inspect.getsourcefile(func) == inspect.getsourcefile(scheduler_module), name
        assert func.__qualname__ == f"Scheduler.{name}", name


def _imports(path: Path, package: str) -> set[str]:
    """Every module `path` names in an import, wherever the import statement is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _import_graph(top: str) -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    for path in (ROOT / top).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(p for p in parts if p != "__init__")] = path
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        graph[module] = {name for name in _imports(path, package) if name in modules and name != module}
    return graph


def test_scheduler_svc_has_no_import_circle():
    graph = _import_graph("scheduler_svc")
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert circles == []


def test_the_core_folder_stays_small():
    assert len(list((ROOT / "scheduler_svc" / "core").glob("*.py"))) <= 20
