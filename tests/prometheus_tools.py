"""Where tests find Prometheus' own binaries: on PATH (`apt-get install prometheus`), else where
`make prometheus-tools` (run by .ci/run) unpacked Debian's package, build/prometheus/usr/bin."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

UNPACKED = Path(__file__).resolve().parents[1] / "build" / "prometheus" / "usr" / "bin"


def prometheus_tool(name: str) -> str | None:
    """The path of `prometheus` or `promtool`; None when neither place has it."""
    unpacked = UNPACKED / name
    return shutil.which(name) or (str(unpacked) if os.access(unpacked, os.X_OK) else None)
