"""Swap preemption on the real default model, SmolLM2-135M-Instruct: eight chats in a pool small
enough to preempt, swapped out and back in, give HF transformers' greedy tokens (fp32)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.smollm2_fixtures import MAX_TOKENS


@pytest.mark.slow
def test_swap_preemption_keeps_hf_greedy_tokens(smollm2_dir, chats, hf_greedy):
    # 12 blocks of 16 slots for eight chats of ~60 tokens: preemptions all along. SmolLM2's block
    # (30 layers, 3 KV heads of 64, fp32) is 720 KiB: 32 MiB of swap space holds 45 of them.
    with LLM(model=str(smollm2_dir), dtype="float32", num_gpu_blocks_override=12, block_size=16,
             enable_prefix_caching=False, preemption_mode="swap", swap_space=1 / 32) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": c} for c in chats], params, use_tqdm=False)
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy
    assert stats.num_cpu_blocks == 45 and stats.num_swap_preemptions > 0
    assert stats.blocks_swapped_out > 0 and stats.blocks_swapped_in > 0
