"""Cancellation soak through real processes: clients hang up at random moments, nothing leaks.

After `benchmarks.soak` (300 requests, 20% hung up, 30% not streamed, 5% malformed, fake worker) the engine is idle, every block is
back, the pool invariant holds and the worker holds no request state (it reports its resident count
with each step result; the scheduler surfaces it as EngineStats.worker_resident_requests).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest

from tests.e2e.conftest import REPO
from tests.e2e.gateway_conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NUM_REQUESTS = 300


@pytest.fixture
def stack(fake_stack):
    return fake_stack


def test_worker_reports_resident_requests_while_they_run(small_queue_stack):
    """The observable is live: non-zero while a request runs, zero after it finished.

    2000 tokens keep the request resident for seconds on the fake worker: more than the shared
    fake stack's context, so this runs on the small-queue stack (full context, one request here)."""
    stack = small_queue_stack
    body = {"prompt": [5, 6, 7], "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    hung_up = threading.Event()

    def stream_then_hang_up() -> None:
        with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=30) as response:
            for _ in response.iter_lines():
                if hung_up.is_set():
                    return

    reader = threading.Thread(target=stream_then_hang_up)
    reader.start()
    try:
        wait_for(lambda: stack.stats().worker_resident_requests == 1)
    finally:
        hung_up.set()
        reader.join(30)
    wait_for(lambda: (s := stack.stats()).idle and s.worker_resident_requests == 0)
    assert stack.stats().num_used_blocks == 0


def test_soak_with_random_hang_ups_leaks_nothing(stack):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--base-url", stack.http_url,
         "--scheduler", stack.scheduler.target, "--num-requests", str(NUM_REQUESTS),
         "--cancel-fraction", "0.2", "--stream-fraction", "0.7", "--bad-fraction", "0.05",
         "--vocab-size", "500", "--seed", "7", "--rss-every", "100"],
        cwd=REPO, capture_output=True, text=True, timeout=150)
    report = json.loads(result.stdout)
    print(json.dumps(report))  # the figures for the record (pytest -s)
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["sent"] == NUM_REQUESTS
    assert [s["requests"] for s in report["rss_samples"]] == list(range(100, NUM_REQUESTS + 1, 100))
    assert report["cancelled"] > 0.1 * NUM_REQUESTS
    assert report["bad_rejected"] > 0 and report["bad_mishandled"] == 0
    assert report["lost"] == 0
    assert report["completed"] + report["cancelled"] + report["bad_rejected"] == NUM_REQUESTS
    assert report["engine_idle"] and report["invariant_ok"]
    assert report["leaked_blocks"] == 0 and report["worker_resident_requests"] == 0
    stats = stack.stats()
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks
