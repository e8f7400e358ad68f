"""tests/gpu: real CUDA kernels. Skipped as a whole unless torch sees a CUDA device and cupy imports."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def _why_unavailable() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError or a driver/library mismatch
        return f"cupy unavailable: {exc!r}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if _HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not checked:
            reason, checked = _why_unavailable(), True
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
