"""Tensor parallelism on CPU (gloo): the offline LLM at TP=2 gives TP=1's greedy tokens, and
logprobs within 1e-4, on a mix with chunked prefill, prefix hits, preemption and n=2; a bad
degree is refused before any process starts; a dead rank fails the group loudly.

TP=1 itself equals HF transformers (test_llm_parity.py), so this closes the chain to HF."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from worker_svc.parallel.distributed import TensorParallelError

SYSTEM_LEN = 40
LOGPROB_TOLERANCE = 1e-4
# Tight pool (24 blocks of 8 = 192 slots for 12 sequences) and small chunks: preemption, chunking.
ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 8, "num_gpu_blocks_override": 24,
          "max_num_batched_tokens": 64, "long_prefill_token_threshold": 16, "seed": 0}


def make_workload(vocab_size: int = 2048) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(7)
    system = [rng.randrange(10, vocab_size) for _ in range(SYSTEM_LEN)]
    prompts = []
    for i in range(12):
        own = [rng.randrange(10, vocab_size) for _ in range(rng.randint(3, 70))]
        prompts.append({"prompt_token_ids": system + own[:20] if i % 2 else own})
    params = [SamplingParams(n=2 if i % 5 == 0 else 1, temperature=0.0, max_tokens=rng.randint(6, 14),
                             logprobs=3) for i in range(12)]
    return prompts, params


def run(llm: LLM) -> tuple[list[Any], Any]:
    prompts, params = make_workload()
    first = llm.generate(prompts[1:2], params[1:2], use_tqdm=False)  # registers the system prompt
    rest = llm.generate(prompts[:1] + prompts[2:], params[:1] + params[2:], use_tqdm=False)
    return first + rest, llm.stats()


def completions(outputs: list[Any]) -> list[list[int]]:
    return [c.token_ids for out in outputs for c in out.outputs]


@pytest.fixture(scope="module")
def tp1_run(tiny_model_dir: str):
    return run(LLM(model=tiny_model_dir, tensor_parallel_size=1, **ENGINE))


@pytest.fixture(scope="module")
def tp2_llm(tiny_model_dir: str):
    llm = LLM(model=tiny_model_dir, tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.close()


@pytest.mark.slow
def test_tp2_greedy_tokens_and_logprobs_equal_tp1(tp1_run, tp2_llm: LLM) -> None:
    (expected, expected_stats), (got, got_stats) = tp1_run, run(tp2_llm)
    assert expected_stats.num_preemptions > 0 and expected_stats.prefix_hits > 0  # the mix is real
    # Scheduling does not depend on the degree, so the runs are step-for-step the same.
    assert (got_stats.num_preemptions, got_stats.prefix_hits) == (
        expected_stats.num_preemptions, expected_stats.prefix_hits)
    assert completions(got) == completions(expected)
    for got_out, exp_out in zip(got, expected, strict=True):
        for got_c, exp_c in zip(got_out.outputs, exp_out.outputs, strict=True):
            for g, e in zip(got_c.logprobs, exp_c.logprobs, strict=True):
                assert abs(g.logprob - e.logprob) < LOGPROB_TOLERANCE
                assert [t for t, _ in g.top] == [t for t, _ in e.top]
                assert max(abs(a - b) for (_, a), (_, b) in zip(g.top, e.top, strict=True)) \
                    < LOGPROB_TOLERANCE


@pytest.mark.slow
def test_dead_rank_fails_the_group(tp2_llm: LLM) -> None:
    # Runs after the parity test (same module LLM): it kills that LLM's follower.
    import os
    import signal

    [pid] = tp2_llm.runner.follower_pids
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError):
        tp2_llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(TensorParallelError):  # stays down: no silent half-group
        tp2_llm.runner.reset()


@pytest.mark.parametrize("degree", [3, 8])
def test_degree_that_does_not_divide_the_heads_is_refused(tiny_model_dir: str, degree: int) -> None:
    # The tiny model has 4 query heads and 2 KV heads: refused before any rank is spawned.
    with pytest.raises(TensorParallelError, match="must divide the model's num_"):
        LLM(model=tiny_model_dir, tensor_parallel_size=degree, **ENGINE)

