"""Greedy `LLM.generate` is token-identical to HF transformers `generate` (fp32, CPU) for the
families added after the Llama four: Phi-3, OLMo 2, Granite, the mixture-of-experts Mixtral,
Qwen3-MoE, OLMoE, sliding-window Mistral and Qwen2 (windows of 16 and 12 tokens, blocks of 8,
prompts and outputs past them; tests/worker/hf_models.py builds them), and Gemma 2 / 3 (local layers
windowed at 16 between global ones, soft-capped scores and logits). In a roomy pool with chunked
prefill, in a cramped one that preempts, and over a shared prefix served from the prefix cache."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import transformers

from pagoda import LLM, SamplingParams
from tests.worker.hf_models import VOCAB, build_hf_model

NUM_PROMPTS = 12
SYSTEM_PROMPT_LEN = 24
BLOCK_SIZE = 8


@pytest.fixture(scope="module", params=["phi3", "olmo2", "granite", "mixtral", "qwen3_moe", "olmoe",
                                                      "mistral_swa", "qwen2_swa", "gemma2", "gemma3"])
def family(request, tmp_path_factory) -> dict[str, Any]:
    """The checkpoint, prompts and HF's greedy continuations (computed once per family)."""
    model_dir = build_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=5)
    rng = random.Random(4)
    plain = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(NUM_PROMPTS)]
    system = [rng.randrange(3, VOCAB) for _ in range(SYSTEM_PROMPT_LEN)]
    shared = [system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    max_tokens = [rng.randint(8, 16) for _ in range(NUM_PROMPTS)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()

    @torch.inference_mode()
    def reference(prompt: list[int], new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=[2], pad_token_id=2,
                          temperature=None, top_p=None, top_k=None)
        return out[0, len(prompt):].tolist()

    return {"kind": request.param, "dir": str(model_dir), "reference": reference, "plain": plain, "shared": shared, "max_tokens": max_tokens,
            "plain_ref": [reference(p, m) for p, m in zip(plain, max_tokens, strict=True)],
            "shared_ref": [reference(p, m) for p, m in zip(shared, max_tokens[:len(shared)], strict=True)]}


def generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens],
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model=model_dir, dtype="float32", device="cpu", seed=0, block_size=BLOCK_SIZE, **kwargs)


def test_roomy_pool_chunked_prefill(family: dict[str, Any]) -> None:
    # Prompts past 16 tokens are prefilled in chunks of at most 16, batched with others' decodes.
    with make_llm(family["dir"], max_num_batched_tokens=64, long_prefill_token_threshold=16) as llm:
        assert generate(llm, family["plain"], family["max_tokens"]) == family["plain_ref"]


def test_cramped_pool_preempts(family: dict[str, Any]) -> None:
    # 12 blocks of 8 = 96 slots: one sequence fits, the twelve at once are far from it.
    with make_llm(family["dir"], num_gpu_blocks_override=12) as llm:
        assert generate(llm, family["plain"], family["max_tokens"]) == family["plain_ref"]
        assert llm.stats().num_preemptions > 0


def test_shared_prefix_hits_the_cache(family: dict[str, Any]) -> None:
    shared, max_tokens = family["shared"], family["max_tokens"][:len(family["shared"])]
    with make_llm(family["dir"]) as llm:
        got = generate(llm, shared[:1], max_tokens[:1]) + generate(llm, shared[1:], max_tokens[1:])
        assert llm.stats().prefix_hits > 0
    assert got == family["shared_ref"]


def test_window_blocks_return_to_the_pool(family: dict[str, Any]) -> None:
    # Mistral's every layer has a 16-token window: three 120-token prompts, 30 tokens each, in
    # chunks of 16, over 20 blocks of 8. Each would need 19 blocks if it kept its whole context
    # (57 > 20: preemptions); holding only its window (3 blocks) and a chunk, all three fit.
    if family["kind"] != "mistral_swa":
        pytest.skip("only Mistral windows every layer (Qwen2's layer 0 attends to all)")
    rng = random.Random(9)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(120)] for _ in range(3)]
    with make_llm(family["dir"], num_gpu_blocks_override=20, max_num_batched_tokens=48,
                  long_prefill_token_threshold=16) as llm:
        assert llm.worker_info.sliding_window == 16
        got = generate(llm, prompts, [30] * 3)
        assert llm.stats().num_preemptions == 0
    assert got == [family["reference"](p, 30) for p in prompts]
