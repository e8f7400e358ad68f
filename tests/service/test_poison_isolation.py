"""Poison isolation through the services: scheduler server -> Steps stream -> worker, in-process.

A test-only fault hook (worker_svc/fault_injection.py) makes the worker's step raise whenever it
samples for one request id. That request must fail alone with INTERNAL, within a few steps, while
16 concurrent requests get exactly their tokens; the scheduler must not loop on resyncs.
"""

from __future__ import annotations

import asyncio

import grpc

from tests.service.test_engine_service import (
    collect,
    expect_status,
    expected,
    generate_request,
    wait_for_stats,
)
from worker_svc import fault_injection

MAX_TOKENS = 20


def prompts() -> dict[str, list[int]]:
    return {f"ok{i}": [1 + i, 2, 3 + i % 4] for i in range(16)}


async def run_with_poison(stub) -> dict[str, list[int]]:
    """16 good requests and "poison", all concurrent: {request id: tokens} of the good ones."""
    good = {rid: collect(stub, generate_request(rid, prompt, MAX_TOKENS)) for rid, prompt in prompts().items()}
    poisoned = expect_status(stub.Generate(generate_request("poison", [9, 9, 9], MAX_TOKENS)),
                             grpc.StatusCode.INTERNAL, "the model failed on this request: step failed: "
                             "injected fault")
    *outputs, _ = await asyncio.gather(*good.values(), poisoned)
    return {rid: tokens[0] for rid, (tokens, _) in zip(good, outputs, strict=True)}


async def test_a_poisoned_request_fails_alone_and_16_others_get_their_tokens(fake_worker, engine_factory,
                                                                             monkeypatch):
    monkeypatch.setattr(fault_injection, "fail_request_ids", frozenset({"poison"}))
    _, stub = await engine_factory(worker_timeout_s=30)
    tokens = await run_with_poison(stub)
    assert tokens == {rid: expected(prompt, MAX_TOKENS) for rid, prompt in prompts().items()}
    stats = await wait_for_stats(stub, lambda s: s.idle)
    assert (stats.num_step_failures, stats.num_requests_isolated) == (2, 1)
    assert stats.invariant_ok and stats.num_used_blocks == 0 and stats.request_success["length"] == 16
    assert stats.worker_connected  # resynced, not given up
    again, _ = await collect(stub, generate_request("after", [5, 6], 4))  # the engine serves on
    assert again == {0: expected([5, 6], 4)}
