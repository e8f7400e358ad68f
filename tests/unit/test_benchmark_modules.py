"""Every benchmark module imports: they run by hand (python -m benchmarks.X), so an import broken by a
change elsewhere (a helper moved to another module) would otherwise show only on the day someone
needs the figures. Importing runs no benchmark: each starts from its main()."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

MODULES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")
                 if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_the_benchmark_module_imports(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__, f"benchmarks/{name}.py says what it measures in its docstring"
