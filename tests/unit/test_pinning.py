"""Pinned prefixes (core/pinning.py): prefilled once, never evicted, hit from the first request on."""

from __future__ import annotations

import pytest

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core import EngineRequest, SchedulerConfig
from tests.unit.test_poison_isolation import Run

BS = 4
SYSTEM = list(range(100, 113))  # 13 tokens: 3 full blocks of 4 to pin


def config(**overrides) -> SchedulerConfig:
    base = dict(num_blocks=24, block_size=BS, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
    return SchedulerConfig(**{**base, **overrides})


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens))


def flood(n: int) -> list[EngineRequest]:
    """Distinct prompts that together need more blocks than the pool: LRU evicts every unpinned one."""
    return [request(f"flood{i}", [1000 + 20 * i + j for j in range(14)]) for i in range(n)]


def run_flood_then_user(pin: bool) -> tuple[Run, int]:
    run = Run(config(), lambda plan, result: False)
    if pin:
        run.scheduler.pin_prompt(SYSTEM)
    run.go([(0, r) for r in flood(12)] + [(40, request("user", SYSTEM + [7, 8, 9]))])
    return run, run.cached_tokens["user"]


def test_a_pinned_prompt_survives_an_lru_flood_and_its_first_user_hits_it() -> None:
    run, cached = run_flood_then_user(pin=True)
    assert run.scheduler.num_pinned_blocks == 3 and cached == 12
    assert run.scheduler.stats().num_used_blocks == 3  # the pins, and nothing else, stay in use
    _, cached_without = run_flood_then_user(pin=False)
    assert cached_without == 0  # the same flood evicts an unpinned prefix


def test_pins_are_taken_again_after_a_worker_loss() -> None:
    failed = []

    def lose_once(plan, result):  # the step after the pin's prefill fails: the pool is reset
        if plan.step_id == 3 and not failed:
            failed.append(1)
            return True
        return False

    run = Run(config(), lose_once)
    run.scheduler.pin_prompt(SYSTEM)
    run.go([(0, request("a", [1, 2, 3], 6)), (30, request("user", SYSTEM + [5]))])
    assert failed and run.scheduler.num_pinned_blocks == 3 and run.cached_tokens["user"] == 12


def test_pinning_needs_prefix_caching_and_a_full_block() -> None:
    run = Run(config(enable_prefix_caching=False), lambda plan, result: False)
    with pytest.raises(InvalidRequestError, match="prefix caching"):
        run.scheduler.pin_prompt(SYSTEM)
    with pytest.raises(InvalidRequestError, match="more than one block"):
        Run(config(), lambda plan, result: False).scheduler.pin_prompt([1, 2, 3])
