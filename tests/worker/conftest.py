"""Shared worker fixtures: one tiny generated model per session, made with `pagoda.tools.tiny_model`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("models") / "pagoda-tiny"
    subprocess.run([sys.executable, "-m", "pagoda.tools.tiny_model", "--out", str(out)], cwd=REPO_ROOT,
                   check=True, capture_output=True, timeout=240)
    return str(out)
