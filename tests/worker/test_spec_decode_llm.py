"""Speculative decoding (n-gram and suffix) on the real model runner (the tiny generated model).

Greedy: outputs with speculation on are token-identical to speculation off, for a mixed batch with
chunked prefill, prefix hits and preemption. Sampling: the verifier's rejection rule leaves the
distribution of every emitted token exactly the sampler's (a statistical test over many seeded rows
on a small vocabulary).
"""

from __future__ import annotations

import pytest
import torch

from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from worker_svc.sampler import Sampler, SamplingRow
from worker_svc.spec_verify import DraftVerifier

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}


def mixed_prompts() -> list[dict]:
    shared = [5, 6, 7, 8, 9] * 5  # a common prefix (prefix hits) that also repeats (drafts)
    prompts = [shared + [10 + i, 11, 12] * (1 + i % 3) for i in range(6)]
    prompts.append([3] * 40)  # long enough to be chunked at the small threshold
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("method", [SPEC, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("num_blocks", [256, 24])  # 24 blocks of 4: the batch must preempt
def test_greedy_with_speculation_matches_without(tiny_model_dir: str, num_blocks: int, method: dict) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs, stats = {}, {}
    for spec in (None, method):
        llm = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks_override=num_blocks,
                  max_num_batched_tokens=64, long_prefill_token_threshold=16, speculative_config=spec)
        results = llm.generate(mixed_prompts(), params, use_tqdm=False)
        outputs[spec is not None] = [r.outputs[0].token_ids for r in results]
        for r in results:  # vLLM's RequestOutput.metrics: what per-request TTFT / TPOT are read from
            assert r.metrics.arrival_time <= r.metrics.first_token_time <= r.metrics.finished_time
        stats[spec is not None] = llm.scheduler
        if spec is not None and spec["method"] == "suffix":
            # Again: now every answer is in the cache of finished outputs, which suffix decoding
            # drafts from, so more is accepted, and the outputs stay the same.
            core = llm.scheduler
            first = core.spec_num_accepted_tokens
            again = llm.generate(mixed_prompts(), params, use_tqdm=False)
            assert [r.outputs[0].token_ids for r in again] == outputs[True]
            assert core.spec_num_accepted_tokens - first > first
        llm.close()
    assert outputs[True] == outputs[False]
    spec_core = stats[True]
    assert spec_core.spec_num_drafts > 0 and spec_core.spec_num_accepted_tokens > 0
    assert spec_core.stats().prefix_hits > 0
    if num_blocks == 24:
        assert spec_core.stats().num_preemptions > 0
    assert spec_core.stats().num_used_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_speculation_with_tensor_or_pipeline_parallelism_matches_one_rank(tiny_model_dir: str, tp: int,
                                                                         pp: int) -> None:
    """The followers learn which drafts the sampling rank accepted and roll back alike (a wrong
    rollback on any rank would change the next steps' tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = []
    for sizes in ((1, 1), (tp, pp)):
        with LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks_override=24,
                 max_num_batched_tokens=64, long_prefill_token_threshold=16, speculative_config=SPEC,
                 tensor_parallel_size=sizes[0], pipeline_parallel_size=sizes[1]) as llm:
            outputs.append([r.outputs[0].token_ids for r in llm.generate(mixed_prompts(), params, use_tqdm=False)])
            assert llm.scheduler.spec_num_accepted_tokens > 0 and llm.scheduler.stats().num_preemptions > 0
    assert outputs[1] == outputs[0]


def test_rejection_sampling_keeps_the_distribution() -> None:
    """Vocabulary 4, fixed logits at 3 positions, drafts [1, 2]: over 6,000 seeded rows, the first
    and second emitted tokens are distributed as p at their positions (the second conditioned on
    the first being the draft, which is what p at position 1 was computed after)."""
    torch.manual_seed(0)
    vocab, num_rows = 4, 6000
    base_logits = torch.tensor([[1.0, 0.5, -0.5, 0.0], [0.2, -1.0, 1.5, 0.3], [0.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(base_logits, dim=-1)
    verifier = DraftVerifier(Sampler((), torch.device("cpu")), seed=0)
    drafts = [1, 2]
    items = [(SamplingRow(SamplingParams(temperature=1.0, seed=seed, max_tokens=8), [7, 7, 7], 3), drafts)
             for seed in range(num_rows)]
    results = verifier(base_logits.repeat(num_rows, 1), items)
    first = torch.bincount(torch.tensor([r[0] for r in results]), minlength=vocab) / num_rows
    seconds = [r[1] for r in results if r[0] == drafts[0]]
    second = torch.bincount(torch.tensor(seconds), minlength=vocab) / len(seconds)
    # Standard error of a frequency near 0.3 over ~6,000 (~1,300) rows: ~0.006 (~0.013).
    assert torch.allclose(first, p[0], atol=0.025), (first, p[0])
    assert torch.allclose(second, p[1], atol=0.05), (second, p[1])
    assert all(1 <= len(r) <= 3 for r in results)
    assert verifier(base_logits.repeat(num_rows, 1)[:3], items[:1]) == results[:1]  # seeded: repeatable
