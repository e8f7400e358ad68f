"""One way every benchmark writes its result: indented JSON, parent folders made, a final newline.

Standard library only: the peer engines' venvs import it too (benchmarks.vs_vllm_offline).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(path: str | Path, result: Any) -> Path:
    """Write `result` (anything json.dumps takes) to `path`; returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
