"""Two model pools behind one gateway, real processes on loopback, the real `openai` client.

Two worker + scheduler pairs serve the tiny model's weights under two names, "tiny-a" and
"tiny-b" (`--scheduler tiny-a=HOST:PORT --scheduler tiny-b=HOST:PORT --fallback-model tiny-a=tiny-b`):
- /v1/models lists both; `model` picks the pool and the reply names it; an unknown model is a 404;
- tiny-a's scheduler runs one request and queues one more: a burst for tiny-a is answered partly by
  tiny-a, the rest (refused RESOURCE_EXHAUSTED: shedding) by tiny-b, every request exactly once;
- SIGKILL tiny-a's scheduler and worker: requests for tiny-a are answered by tiny-b (the reply says
  so), and `pagoda:fallback_requests_total` counts them; once tiny-a is back it answers again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from tests.e2e.conftest import ENGINE_WORKER_FLAGS, free_port
from tests.e2e.gateway_conftest import start_gateway
from tests.reliability.conftest import Stack, scheduler_process, worker_process
from tests.reliability.test_replicas import _metric

pytestmark = pytest.mark.slow
POOLS = ("tiny-a", "tiny-b")
SMALL_QUEUE = {"max_num_seqs": 1, "max_waiting_requests": 1}  # tiny-a's: it sheds beyond two


@pytest.fixture(scope="module")
def pools(tmp_path_factory, tiny_model_dir):
    """{pool name: Stack} and the gateway's URL."""
    log_dir = tmp_path_factory.mktemp("model-pools")
    stacks: dict[str, Stack] = {}
    gateway = None
    try:
        for name in POOLS:
            flags = SMALL_QUEUE if name == "tiny-a" else {}
            worker = worker_process(log_dir, free_port(), tiny_model_dir, **ENGINE_WORKER_FLAGS)
            scheduler = scheduler_process(worker.target, log_dir, free_port(), **flags)
            stacks[name] = Stack(log_dir, worker, scheduler, model=tiny_model_dir,
                                 worker_flags=ENGINE_WORKER_FLAGS, scheduler_flags=flags)
        for stack in stacks.values():
            stack.scheduler.wait_serving()
        entries = ",".join(f"{name}={stack.scheduler.target}" for name, stack in stacks.items())
        gateway, url = start_gateway(entries, log_dir, "--fallback-model", "tiny-a=tiny-b",
                                     "--replica-stats-interval", "0.1", "--breaker-cooldown", "1")
        yield stacks, url
    finally:
        for process in (gateway, *stacks.values()):
            if process is not None:
                process.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt="The river", max_tokens=6, temperature=0)


def test_models_lists_both_pools_and_the_model_picks_one(pools):
    _, url = pools
    client = _client(url)
    assert sorted(m.id for m in client.models.list().data) == sorted(POOLS)
    replies = {name: _complete(client, name) for name in POOLS}
    assert {name: r.model for name, r in replies.items()} == {name: name for name in POOLS}
    assert replies["tiny-a"].choices[0].text == replies["tiny-b"].choices[0].text  # the same weights
    with pytest.raises(openai.NotFoundError) as refused:
        _complete(client, "no-such-model")
    assert refused.value.status_code == 404 and "no-such-model" in refused.value.message


def test_a_burst_beyond_pool_as_queue_is_answered_by_b_and_counted_as_shedding(pools):
    _, url = pools
    before = _metric(url, "pagoda:fallback_requests_total", requested_model="tiny-a",
                     served_model="tiny-b", reason="shedding")

    async def burst() -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        async with client:
            return await asyncio.gather(*(client.completions.create(
                model="tiny-a", prompt=f"The river {i}", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
                for i in range(8)))

    replies = asyncio.run(burst())
    served = [r.model for r in replies]
    assert all(r.choices[0].finish_reason == "length" for r in replies)  # each answered in full, once
    assert served.count("tiny-a") >= 2 and served.count("tiny-b") >= 1, served
    assert _metric(url, "pagoda:fallback_requests_total", requested_model="tiny-a", served_model="tiny-b",
                   reason="shedding") == before + served.count("tiny-b")


def test_with_pool_a_killed_its_requests_are_answered_by_b_and_counted(pools):
    stacks, url = pools
    client = _client(url)
    victim = stacks["tiny-a"]
    before = _metric(url, "pagoda:fallback_requests_total", requested_model="tiny-a",
                     served_model="tiny-b", reason="unavailable")
    os.kill(victim.scheduler.proc.pid, signal.SIGKILL)
    os.kill(victim.worker.proc.pid, signal.SIGKILL)
    victim.scheduler.proc.wait(10), victim.worker.proc.wait(10)
    replies = [_complete(client, "tiny-a") for _ in range(3)]
    stream = client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True)
    streamed = [chunk.model for chunk in stream]
    assert [r.model for r in replies] == ["tiny-b"] * 3 and set(streamed) == {"tiny-b"}
    assert all(r.choices[0].finish_reason == "length" for r in replies)
    assert _metric(url, "pagoda:fallback_requests_total", requested_model="tiny-a",
                   served_model="tiny-b", reason="unavailable") == before + 4
    assert _complete(client, "tiny-b").model == "tiny-b"  # b's own requests are untouched
    # tiny-a comes back on the same ports: once its breaker closes it answers for itself again.
    victim.restart_worker()
    victim.restart_scheduler()
    end = time.monotonic() + 20
    while _complete(client, "tiny-a").model != "tiny-a":
        assert time.monotonic() < end, "tiny-a never answered again"
        time.sleep(0.2)  # poll; bounded by the deadline
