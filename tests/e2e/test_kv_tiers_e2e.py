"""The prefix cache's host tier through real processes (tiny model worker, scheduler, gateway on
loopback) and the openai client: a conversation whose prefix other sessions evicted from the device
pool is served from the host tier on its next turn (usage.prompt_tokens_details.cached_tokens > 0),
and every greedy completion is identical with and without the tier; with the disk tier, the same
turn after a worker restart (scheduler and gateway kept) is a hit from disk with identical output;
a session lease keeps a history pinned through a flood until DELETE /v1/sessions/{id} ends it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from openai import BadRequestError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ServiceProcess, flag_args, start_scheduler, start_worker
from tests.e2e.gateway_conftest import start_gateway

# 14 device blocks of 16 tokens hold about one 150-token session; 4 MiB of host tier holds 64
# blocks of the tiny model (64 KiB each).
WORKER_FLAGS = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 14}


@contextmanager
def serving(model_dir, log_dir, **worker_flags) -> Iterator[str]:
    """A fresh worker + scheduler + gateway on loopback; yields the gateway's HTTP URL and stops
    all three (gateway first) whatever happens inside."""
    worker = start_worker(model_dir, log_dir, **WORKER_FLAGS, **worker_flags)
    try:
        scheduler = start_scheduler(worker.target, log_dir, max_num_seqs=4)
        try:
            gateway, http_url = start_gateway(scheduler.target, log_dir)
            try:
                yield http_url
            finally:
                gateway.stop()
        finally:
            scheduler.stop()
    finally:
        worker.stop()


def run_turns(model_dir, log_dir, **worker_flags) -> tuple[list[str], list[int]]:
    """Session 0's two turns around three other sessions that fill the device pool, through a
    fresh stack: every completion's text and cached tokens."""
    log_dir.mkdir()
    with serving(model_dir, log_dir, **worker_flags) as http_url:
        return converse(OpenAI(base_url=f"{http_url}/v1", api_key="unused"), str(model_dir))


def converse(client: OpenAI, model: str) -> tuple[list[str], list[int]]:
    rng = random.Random(3)
    sessions = [[rng.randrange(10, 2000) for _ in range(120)] for _ in range(4)]
    texts, cached = [], []

    def turn(prompt: list[int]) -> None:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        texts.append(reply.choices[0].text)
        details = reply.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details is not None else 0)

    for session in sessions:  # session 0 first; the others evict its blocks from the device
        turn(session)
    turn(sessions[0] + [rng.randrange(10, 2000) for _ in range(20)])  # its second turn
    return texts, cached


@pytest.mark.timeout(600)
def test_a_turn_after_eviction_hits_the_host_tier_with_identical_output(tiny_model_dir, tmp_path):
    plain_texts, plain_cached = run_turns(tiny_model_dir, tmp_path / "plain")
    tier_texts, tier_cached = run_turns(tiny_model_dir, tmp_path / "tier", kv_offloading_size=4 / 1024)
    assert tier_texts == plain_texts
    assert plain_cached == [0, 0, 0, 0, 0]  # evicted: the second turn recomputes its history
    assert tier_cached == [0, 0, 0, 0, 112]  # its 7 full prompt blocks, loaded from the host


@pytest.mark.timeout(600)
def test_a_worker_restart_between_turns_hits_the_disk_tier_with_identical_output(tiny_model_dir, tmp_path):
    """4 host blocks over a disk tier: session 0's blocks go device -> host -> disk while the other
    sessions run; the worker is stopped and a new one started on the same port (its host RAM is
    gone, its files are not); the scheduler reconnects, rebuilds its disk index from the new
    worker's Init, and session 0's next turn loads its 7 prompt blocks from disk."""
    plain_texts, _ = run_turns(tiny_model_dir, tmp_path / "plain")
    flags = {**WORKER_FLAGS, "kv_offloading_size": 4 * 64 / (1 << 20), "kv_offload_dir": tmp_path / "kv",
             "kv_offload_dir_size": 4 / 1024}
    (tmp_path / "disk").mkdir()
    worker = start_worker(tiny_model_dir, tmp_path / "disk", **flags)
    scheduler = start_scheduler(worker.target, tmp_path / "disk", max_num_seqs=4)
    gateway, http_url = start_gateway(scheduler.target, tmp_path / "disk")
    try:
        client, model = OpenAI(base_url=f"{http_url}/v1", api_key="unused"), str(tiny_model_dir)
        rng = random.Random(3)  # converse()'s sessions and second turn
        sessions = [[rng.randrange(10, 2000) for _ in range(120)] for _ in range(4)]
        texts = [client.completions.create(model=model, prompt=s, max_tokens=8, temperature=0).choices[0].text
                 for s in sessions]
        worker.stop()  # SIGTERM: the host tier goes with the process
        (tmp_path / "restarted").mkdir()
        worker = ServiceProcess("worker", "worker_svc", ["--port", str(worker.port), "--model", str(tiny_model_dir),
                                                         *flag_args(flags)], worker.port, tmp_path / "restarted")
        reply = client.completions.create(model=model, prompt=sessions[0] + [rng.randrange(10, 2000) for _ in range(20)],
                                          max_tokens=8, temperature=0)
        texts.append(reply.choices[0].text)
        assert reply.usage.prompt_tokens_details.cached_tokens == 112  # its 7 full prompt blocks, from disk
        assert texts == plain_texts
        loaded = [sample.value for family in text_string_to_metric_families(httpx.get(f"{http_url}/metrics").text)
                  for sample in family.samples if sample.name == "pagoda:disk_loaded_blocks_total"]
        assert loaded == [7.0]
    finally:
        gateway.stop()
        scheduler.stop()
        worker.stop()


@pytest.mark.timeout(600)
def test_a_session_lease_keeps_the_history_through_a_flood_until_deleted(tiny_model_dir, tmp_path):
    """No host tier: the lease alone keeps session s1's 7 blocks pinned while three other prompts
    cycle the rest of the pool; without a session_id the same flood evicts them. DELETE ends it."""
    with serving(tiny_model_dir, tmp_path) as http_url:
        client = OpenAI(base_url=f"{http_url}/v1", api_key="unused")
        model = str(tiny_model_dir)
        rng = random.Random(5)

        def cached_after_flood(session: dict) -> int:
            history = [rng.randrange(10, 2000) for _ in range(120)]
            client.completions.create(model=model, prompt=history, max_tokens=8, temperature=0,
                                      extra_body=session)
            for _ in range(3):  # 60 tokens + 8: 5 blocks each, beside the lease's 7
                client.completions.create(model=model, prompt=[rng.randrange(10, 2000) for _ in range(60)],
                                          max_tokens=8, temperature=0)
            reply = client.completions.create(model=model, prompt=history + [7, 8, 9], max_tokens=1,
                                              temperature=0, extra_body=session)
            return reply.usage.prompt_tokens_details.cached_tokens

        assert cached_after_flood({}) < 112  # evicted by the flood
        assert cached_after_flood({"session_id": "s1", "session_ttl": 300}) == 112
        assert httpx.delete(f"{http_url}/v1/sessions/s1").json() == \
            {"id": "s1", "object": "session", "deleted": True}
        assert httpx.delete(f"{http_url}/v1/sessions/s1").status_code == 404
        with pytest.raises(BadRequestError):  # a TTL must be positive
            client.completions.create(model=model, prompt=[5, 6], max_tokens=1,
                                      extra_body={"session_id": "s2", "session_ttl": 0})
