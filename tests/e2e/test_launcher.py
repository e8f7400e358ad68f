"""`python -m pagoda.entrypoints.launcher` brings the stack up, serves, and stops every child on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest

from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.e2e.conftest import REPO, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_launcher_serves_and_stops_cleanly(tmp_path):
    worker_port, scheduler_port = free_port(), free_port()
    log = open(tmp_path / "launcher.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagoda.entrypoints.launcher", "--fake", "--no-gateway", "--device", "cpu",
         "--worker-port", str(worker_port), "--scheduler-port", str(scheduler_port),
         "--shutdown-timeout", "7"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 60
        while "Pagoda is serving" not in (tmp_path / "launcher.log").read_text():
            assert proc.poll() is None and time.monotonic() < end, (tmp_path / "launcher.log").read_text()
            time.sleep(0.1)  # poll interval; the deadline bounds the wait
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            request = engine_pb2.GenerateRequest(request_id="via-launcher", prompt_token_ids=[1, 2, 3],
                                                 sampling=common_pb2.SamplingParams(max_tokens=5))
            responses = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=30))
        assert sum(len(s.token_ids) for r in responses for s in r.sequences) == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "launcher.log").read_text()
    assert "[launcher] stopped" in text and "scheduler_stopping" in text
    assert '"shutdown_timeout_s": 7.0' in text  # the launcher's flag reached the scheduler
    # Stopped in order: the scheduler drained and stopped before the worker got its SIGTERM.
    assert text.index("scheduler_stopping") < text.index("worker_stopping")


def test_launcher_refuses_to_start_over_a_taken_port():
    """A second stack on the same ports: exit 1 naming the port, before any child starts (the
    readiness probes would otherwise find the first stack's servers and report success)."""
    import socket

    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pagoda.entrypoints.launcher", "--fake", "--no-gateway", "--worker-port", str(port)],
            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"address in use on 127.0.0.1: --worker-port {port}" in done.stderr
    assert "Pagoda is serving" not in done.stdout
