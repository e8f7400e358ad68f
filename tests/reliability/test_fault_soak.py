"""The soak with faults (issue 32), short: `make run DP=2` with fake workers, 200 requests through
the gateway, and while they flow a worker SIGKILLed, a scheduler SIGKILLed and a replica drained
and restarted (benchmarks/soak_faults.py; the launcher restarts what died). Nothing may be lost or
fail, every greedy text must equal the one an undisturbed pass gets on the same stack, and no block
may be left in use on either replica. The fake worker's greedy token is a function of the whole
token history, as a model's is, so a stream recomputed or carried on elsewhere that went wrong
would show as a mismatch.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import REPO, free_port
from tests.reliability.conftest import TOKENIZER_DIR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
NUM_REQUESTS = 200
STRIDE = 10  # the launcher's replica port stride (pagoda/entrypoints/launcher/topology.py)


def _free_pair() -> int:
    """A port p with p + STRIDE free too (replica 1's)."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + STRIDE))
                return port
            except OSError:
                continue


@pytest.fixture
def launcher(tmp_path):
    worker, scheduler, http, grpc_port = _free_pair(), _free_pair(), free_port(), free_port()
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagoda.entrypoints.launcher", "--fake", "--model", str(TOKENIZER_DIR),
             "--data-parallel-size", "2", "--worker-port", str(worker), "--scheduler-port", str(scheduler),
             "--gateway-port", str(http), "--grpc-port", str(grpc_port), "--shutdown-timeout", "10"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 120
        while "Pagoda is serving" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < end, log_path.read_text()[-3000:]
            time.sleep(0.2)  # poll interval; the deadline bounds the wait
        yield {"http": f"http://127.0.0.1:{http}",
               "schedulers": f"127.0.0.1:{scheduler},127.0.0.1:{scheduler + STRIDE}",
               "workers": f"{worker},{worker + STRIDE}", "log": log_path}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_worker_kill_a_scheduler_kill_and_a_rolling_restart_lose_nothing(launcher):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--base-url", launcher["http"],
         "--scheduler", launcher["schedulers"], "--workers", launcher["workers"],
         "--num-requests", str(NUM_REQUESTS), "--concurrency", "16", "--max-tokens", "8",
         "--cancel-fraction", "0.1", "--stream-fraction", "0.6", "--bad-fraction", "0.02",
         "--vocab-size", "500", "--seed", "3", "--fault-timeout", "90",
         "--fault-schedule", "worker@0:30,scheduler@1:80,drain@0:130", "--expected", "after"],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    report = json.loads(result.stdout)
    print(json.dumps(report))  # the figures for the record (pytest -s)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert [(f["kind"], f["replica"], f["error"]) for f in report["faults"]] == [
        ("worker", 0, ""), ("scheduler", 1, ""), ("drain", 0, "")]
    for fault in report["faults"]:  # each process was replaced by a new one, and the replica served again
        assert fault["restarted"].keys() == fault["killed"].keys()
        assert set(fault["restarted"].values()).isdisjoint(fault["killed"].values())
        assert fault["recovered_seconds"] is not None
    assert report["lost"] == 0 and report["failed"] == 0 and report["mismatched"] == 0
    assert report["completed"] > NUM_REQUESTS // 2
    assert report["completed"] + report["cancelled"] + report["bad_rejected"] == NUM_REQUESTS
    assert report["leaked_blocks"] == 0 and report["worker_resident_requests"] == 0
    assert [r["invariant_ok"] and r["idle"] for r in report["replicas"]] == [True, True]
    assert "[launcher] scheduler[0] ready again" in launcher["log"].read_text()
