"""The house is one-way: an AST walk over every product module's imports (function bodies included).

gateway → scheduler_svc → worker_svc → kernels talk only through the wire; what two services share
lives in `pagoda.contract`; `pagoda.runtime` is infrastructure under everything; the user-facing
layer (`pagoda.entrypoints.llm`, the launcher, the tools) sits on top and may import anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "scheduler_svc", "worker_svc")
SHARED = ("pagoda.contract", "pagoda.runtime", "pagoda.v1")
PROJECT = (*SERVICES, "kernels", "pagoda", "benchmarks", "tests")
BELOW_THE_TOP = (*SERVICES, "kernels", *SHARED)
FAKES = ("worker_svc.fake",)
# Composition roots pick an implementation by flag; `--fake` selects the model-less worker there.
FAKE_ROOTS = ("worker_svc.__main__",)

# What each layer may import from the project (its own package is always allowed).
ALLOWED: dict[str, tuple[str, ...]] = {
    "pagoda.contract": ("pagoda.v1",),
    "pagoda.runtime": (),
    "kernels": ("pagoda.runtime",),
    "gateway": SHARED,
    "scheduler_svc": SHARED,
    "worker_svc": (*SHARED, "kernels"),
    "pagoda.entrypoints": BELOW_THE_TOP,
    "pagoda.tools": BELOW_THE_TOP,
    # The package itself only names its lazy exports (`from pagoda import LLM`).
    "pagoda": ("pagoda.contract", "pagoda.entrypoints"),
}
TOP = ("pagoda.entrypoints", "pagoda.tools")


def _layer(module: str) -> str | None:
    """The most specific layer that holds `module`; None: a module outside every layer."""
    holders = [layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")]
    return max(holders, key=len, default=None)


def _product_modules() -> dict[str, Path]:
    modules = {}
    for package in (*SERVICES, "kernels", "pagoda"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[:2] == ("pagoda", "v1"):  # generated protobuf code
                continue
            modules[".".join(p for p in parts if p != "__init__")] = path
    return modules


def _project_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from a import b` may import the module a.b: check both names.
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return [name for name in found if name.split(".")[0] in PROJECT]


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations() -> list[str]:
    modules = _product_modules()
    bad = []
    for module, path in sorted(modules.items()):
        layer = _layer(module)
        for name in _project_imports(path):
            if name in modules or _within(name, ("pagoda.v1",)) or name.count(".") == 0:
                target = name
            else:
                target = name.rsplit(".", 1)[0]  # `from pkg.mod import Class` names pkg.mod
            if _within(target, FAKES) and not (_within(module, FAKES) or module in FAKE_ROOTS
                                               or layer in TOP):
                bad.append(f"{module}: imports the fake {target}")
            if _within(target, (layer,)) and _layer(target) == layer:
                continue
            if target == "pagoda" or not _within(target, ALLOWED[layer]):
                bad.append(f"{module} ({layer}): imports {target}")
    return bad


def test_no_import_crosses_a_boundary():
    assert _violations() == []


def test_the_walk_sees_every_layer():
    layers = {module: _layer(module) for module in _product_modules()}
    assert [module for module, layer in layers.items() if layer is None] == []
    assert set(layers.values()) == set(ALLOWED)


@pytest.mark.parametrize("module, forbidden", [
    ("scheduler_svc.core.scheduler", ("torch", "grpc", "worker_svc", "gateway")),
    ("pagoda.contract.step", ("torch", "grpc", "scheduler_svc", "worker_svc", "gateway")),
    ("pagoda.contract.params", ("torch", "grpc", "scheduler_svc", "worker_svc", "gateway")),
    ("pagoda.contract.worker_codec", ("torch", "scheduler_svc", "worker_svc", "gateway")),
    ("pagoda.contract.error_table", ("torch", "scheduler_svc", "worker_svc", "gateway")),
    ("pagoda.contract.prefix_hash", ("torch", "grpc", "scheduler_svc", "worker_svc", "gateway")),
    ("gateway.upstream.routing", ("torch", "grpc", "scheduler_svc", "worker_svc", "kernels")),
    ("pagoda.runtime.telemetry", ("torch", "scheduler_svc", "worker_svc", "gateway")),
    ("gateway.server", ("torch", "scheduler_svc", "worker_svc", "kernels")),
    ("scheduler_svc.server", ("torch", "worker_svc", "gateway", "kernels")),
])
def test_what_a_module_pulls_in_at_run_time(module, forbidden):
    """The AST rule, checked again on sys.modules after a real import (catches re-exports)."""
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in {forbidden!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "[]"
