"""An OpenAI-compatible server of either side of a side-by-side benchmark (Pagoda, vLLM, llama.cpp):
start it, wait until it serves, stop it. Shared by benchmarks.vs_vllm and benchmarks.vs_llamacpp.

- Servers start in a session of their own, stdout and stderr into one log file.
- They are polled on /v1/models until a model is listed (bounded): every engine here answers 503
  or refuses the connection until its model is loaded.
- They stop with SIGTERM, then SIGKILL of their whole group (the children a server started).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from pagoda.entrypoints.launcher.supervisor import stop_process

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_ready(proc: subprocess.Popen, base_url: str, timeout_s: float) -> tuple[float, str]:
    """Seconds from now until /v1/models lists a model, and that model's id; raises past timeout_s."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as reply:
                models = json.load(reply).get("data") or []
            if models:
                return time.perf_counter() - started, models[0]["id"]
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass  # not listening yet, or listening but not serving (503)
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM and wait (the servers drain on it); then make sure the group it started is gone."""
    code = stop_process(proc, timeout_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stray engine-core / worker children of this server only
    except ProcessLookupError:
        pass
    return code
