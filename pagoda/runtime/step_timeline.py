"""Per-step timestamps for the batch-1 breakdown (`python -m benchmarks.step_breakdown`); off by default.

With `PAGODA_STEP_TIMELINE=DIR` in its environment, a service appends one JSON line per step (or
per streamed token, in the gateway) to `DIR/<service>-<pid>.jsonl`: the step id and the instants
(`time.perf_counter()`, CLOCK_MONOTONIC on Linux, so comparable across the processes of one
machine) at which the step passed each point. The benchmark joins the services' lines by step id
to say where the time between two forwards goes. Off (the default), `record` is never called:
callers test `enabled` first, so a served step pays one attribute read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "PAGODA_STEP_TIMELINE"


class StepTimeline:
    def __init__(self, service: str, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(ENV)
        self._file = None
        if directory:
            path = Path(directory) / f"{service}-{os.getpid()}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            # Line-buffered: a line per step reaches the file even if the process is killed.
            self._file = path.open("a", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(self, **fields: float | int | str) -> None:
        assert self._file is not None, "test `enabled` first"
        self._file.write(json.dumps(fields) + "\n")


def read_timelines(directory: str | Path, service: str) -> list[dict]:
    """Every line the processes named `service` wrote under `directory`, in file order."""
    lines: list[dict] = []
    for path in sorted(Path(directory).glob(f"{service}-*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line]
    return lines
