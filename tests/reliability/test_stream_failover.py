"""Mid-stream failover with real processes: two replicas (fake worker + scheduler each) behind one
gateway, a greedy stream through the real `openai` client, and the replica serving it SIGKILLed
once the first chunks have arrived: its scheduler and worker (the gateway's call breaks:
UNAVAILABLE), or its worker only (its scheduler fails the request UNAVAILABLE, "the worker was
lost", after --worker-timeout). The client's stream does not error and
its full text, finish reason and usage equal an undisturbed run's: the other replica carried the
request on from the tokens already streamed (the fake worker's greedy token is a function of the
whole token history, as a model's is).
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from tests.e2e.conftest import free_port
from tests.e2e.gateway_conftest import start_gateway
from tests.reliability.conftest import TOKENIZER_DIR, Stack, scheduler_process, worker_process
from tests.reliability.test_replicas import _metric

pytestmark = pytest.mark.slow
# Long enough that the stream is still being generated when the kill lands (the fake worker takes
# well over a second for it); the test checks that the failover did happen, so a stream that
# finished first fails it rather than passing vacuously.
MAX_TOKENS = 3000


@pytest.fixture
def replicas(tmp_path):
    stacks, gateway = [], None
    try:
        for _ in range(2):
            worker = worker_process(tmp_path, free_port(), num_gpu_blocks_override=512)
            # A lost worker fails its requests after 1 s (the worker-only case waits that long).
            scheduler = scheduler_process(worker.target, tmp_path, free_port(), worker_timeout=1)
            stacks.append(Stack(tmp_path, worker, scheduler))
        for stack in stacks:
            stack.scheduler.wait_serving()
        gateway, url = start_gateway(",".join(s.scheduler.target for s in stacks), tmp_path,
                                     "--tokenizer", str(TOKENIZER_DIR), "--replica-stats-interval", "0.1")
        yield stacks, url
    finally:
        for process in (gateway, *stacks):
            if process is not None:
                process.stop()


def _create(client: openai.OpenAI, model: str):
    return client.completions.create(
        model=model, prompt="The river", max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})


def _serving(stacks: list[Stack]) -> Stack:
    """The replica running the one request (polled: the scheduler's stats say it)."""
    end = time.monotonic() + 10
    while True:
        running = [s for s in stacks if s.stats().num_running > 0]
        if running:
            return running[0]
        assert time.monotonic() < end, "no replica runs the stream"
        time.sleep(0.01)  # poll interval; the deadline bounds the wait


@pytest.mark.parametrize("kill", ["scheduler and worker", "worker"])
def test_a_greedy_stream_survives_the_death_of_its_replica(replicas, kill):
    stacks, url = replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    expected_chunks = list(_create(client, model))
    expected = "".join(c.text for chunk in expected_chunks for c in chunk.choices)

    chunks, victim = [], None
    for chunk in _create(client, model):  # raises if the stream errors
        chunks.append(chunk)
        if victim is None and sum(bool(c.text) for ch in chunks for c in ch.choices) >= 3:
            victim = _serving(stacks)
            if kill != "worker":
                os.kill(victim.scheduler.proc.pid, signal.SIGKILL)
            os.kill(victim.worker.proc.pid, signal.SIGKILL)
    assert victim is not None
    label = str(stacks.index(victim))
    assert _metric(url, "pagoda:router_stream_failovers_total", replica=label) == 1  # it did fail over
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == expected
    assert len({chunk.id for chunk in chunks}) == 1
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    usage, expected_usage = chunks[-1].usage, expected_chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected_usage.prompt_tokens, MAX_TOKENS)
