"""LLM(pinned_prompts=...): prefilled at construction, the first request hits the whole pinned
prefix, and the output equals an unpinned run's."""

from __future__ import annotations

from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM

SYSTEM = [(7 * i) % 200 + 10 for i in range(37)]  # 9 full blocks of 4


def test_first_request_hits_the_pinned_prefix_and_outputs_match(tiny_model_dir: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = {"prompt_token_ids": SYSTEM + [5, 6, 7]}
    pinned = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks_override=64,
                 pinned_prompts=[SYSTEM])
    assert pinned.stats().num_pinned_blocks == 9
    (out,) = pinned.generate([prompt], params, use_tqdm=False)
    assert out.num_cached_tokens == 36
    plain = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks_override=64)
    (reference,) = plain.generate([prompt], params, use_tqdm=False)
    assert reference.num_cached_tokens == 0
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
