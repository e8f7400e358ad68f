"""Draft-model speculation in the scheduler core, against the fake worker's fake draft model.

The fake draft (worker_svc/fake/fake_draft.py) writes its KV into the same slot array as the
target's and checks, at every proposal, that its table's slots still hold the sequence's tokens:
a draft block freed, shared or reused while the draft needed it fails there. The streams must equal
the reference streams whatever was accepted, and the block accounting (draft tables included)
must hold after every step, through preemption, swap, forks, aborts and worker losses.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core import EngineRequest, SchedulerConfig
from scheduler_svc.core.config import SpeculativeConfig
from tests.unit.test_fake_worker_property import traces
from tests.unit.test_spec_decode import assert_streams, run_trace, samplable, small_vocab_run

DRAFT = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", model="draft")


def test_a_model_key_means_a_draft_model_as_vllm_infers_it() -> None:
    parsed = SpeculativeConfig.parse('{"model": "models/draft", "num_speculative_tokens": 3}')
    assert parsed.method == "draft_model" and parsed.model == "models/draft" and parsed.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="takes no model"):
        SpeculativeConfig.parse({"method": "ngram", "model": "x"})
    with pytest.raises(ValueError, match="needs method 'draft_model'"):
        SpeculativeConfig.parse({"method": "draft_model"})


def test_draft_blocks_are_allocated_rolled_back_and_freed() -> None:
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8,
                             max_num_batched_tokens=64, speculative=DRAFT)
    run = small_vocab_run(config, lambda plan, result: False, 5)
    requests = [(0, EngineRequest(RequestId(f"r{i}"), (3, 1, 2, 3 + i),
                                  SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
                for i in range(3)]
    run.go(requests)
    assert_streams(run, requests)
    core = run.scheduler
    assert 0 < core.spec_num_accepted_tokens < core.spec_num_draft_tokens  # both kinds happen
    drafted = [d for plan, _, _ in run.steps for d in plan.model_drafts]
    assert drafted and not any(plan.draft_token_ids for plan, _, _ in run.steps)
    assert any(d.table_start < d.table_start + len(d.block_ids) for d in drafted)
    assert len(run.steps) < 3 * 40  # fewer steps than one token per step
    assert core.stats().num_used_blocks == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.sampled_from([3, 5, 40]), st.integers(1, 4))
def test_random_traces_with_a_draft_model_keep_invariants_and_streams(trace, vocab, k) -> None:
    config, requests, *_ = trace
    assume(all(samplable(request.sampling, vocab) for _, request in requests))
    config = dataclasses.replace(config, speculative=dataclasses.replace(DRAFT, num_speculative_tokens=k))
    run_trace(config, trace, vocab)


def test_a_thousand_requests_with_aborts_in_a_cramped_pool_leak_no_block() -> None:
    """24 blocks of 4 for up to 8 sequences of up to 40 tokens: drafting competes with
    preemption for every block; a tenth of the requests is aborted mid-run."""
    config = SchedulerConfig(num_blocks=24, block_size=4, max_model_len=40, max_num_seqs=8,
                             max_num_batched_tokens=32, speculative=DRAFT, num_cpu_blocks=8,
                             preemption_mode="swap")
    rng = random.Random(46)
    requests, aborts = [], []
    for i in range(1000):
        prompt = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 12)))
        sampling = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True,
                                  n=rng.choice([1, 1, 1, 2]))
        requests.append((i // 4, EngineRequest(RequestId(f"r{i}"), prompt, sampling)))
        if rng.random() < 0.1:
            aborts.append((i // 4 + rng.randint(0, 6), f"r{i}"))
    run = small_vocab_run(config, lambda plan, result: False, 5)
    run.go(requests, aborts, max_steps=20000)
    assert_streams(run, requests)
    core = run.scheduler
    stats = core.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
    assert stats.num_preemptions > 0 and core.spec_num_accepted_tokens > 0
    assert any(plan.model_drafts for plan, _, _ in run.steps)


def test_no_drafts_in_a_step_running_more_than_disable_by_batch_size() -> None:
    assert DRAFT.max_batch_to_draft == 8  # the draft model's default
    assert SpeculativeConfig(method="ngram").max_batch_to_draft is None
    spec = dataclasses.replace(DRAFT, disable_by_batch_size=2)
    config = SchedulerConfig(num_blocks=128, block_size=4, max_model_len=64, max_num_seqs=8,
                             max_num_batched_tokens=64, speculative=spec)
    run = small_vocab_run(config, lambda plan, result: False, 5)
    requests = [(0, EngineRequest(RequestId(f"r{i}"), (3, 1, 2, 3 + i),
                                  SamplingParams(temperature=0.0, max_tokens=8 + 12 * i, ignore_eos=True)))
                for i in range(3)]
    run.go(requests)
    assert_streams(run, requests)
    # all three arrive at once: a step samples for every running sequence
    running = [len(set(result.request_ids)) for _, result, _ in run.steps]
    drafted = [bool(plan.model_drafts) for plan, _, _ in run.steps]
    assert any(drafted) and 3 in running and not any(d and n > 2 for d, n in zip(drafted, running, strict=True))
