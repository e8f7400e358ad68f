"""One worker + scheduler + gateway stack on the real default model (SmolLM2-135M-Instruct, fp32)
for the OpenAI API tests of issue 23; registered once in tests/e2e/conftest.py (session scope)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import start_scheduler, start_worker
from tests.e2e.gateway_conftest import start_gateway

KV_BYTES = 128 << 20


@pytest.fixture(scope="session")
def smollm2_api(smollm2_dir, tmp_path_factory):
    """The gateway's HTTP URL."""
    logs = tmp_path_factory.mktemp("smollm2-api")
    processes = [start_worker(smollm2_dir, logs, device="cpu", dtype="float32",
                              kv_cache_memory_bytes=KV_BYTES)]
    try:
        processes.append(start_scheduler(processes[0].target, logs, max_num_seqs=32))
        gateway, http_url = start_gateway(processes[1].target, logs, "--enable-auto-tool-choice")
        processes.append(gateway)
        yield http_url
    finally:
        for process in reversed(processes):
            process.stop()
