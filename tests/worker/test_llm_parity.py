"""Headline acceptance: greedy `LLM.generate` is token-identical to HF transformers `generate`
(fp32, CPU) whatever the batch mix, chunk size, prefix hit, preemption or n."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from worker_svc.model_loader.model_config import ModelConfig

NUM_PROMPTS = 32
SYSTEM_PROMPT_LEN = 40
FIRST_ORDINARY_TOKEN = 10


def make_prompts(vocab_size: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(rng.randint(*lengths))]
            for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def workload(tiny_model_dir: str) -> dict[str, Any]:
    """Prompts, per-prompt max_tokens, and HF's greedy continuations (computed once)."""
    from transformers import AutoModelForCausalLM

    config = ModelConfig.from_dir(tiny_model_dir)
    rng = random.Random(1)
    plain = make_prompts(config.vocab_size, seed=2, lengths=(3, 200))
    system = make_prompts(config.vocab_size, seed=3, lengths=(SYSTEM_PROMPT_LEN, SYSTEM_PROMPT_LEN))[0]
    shared = [system + p[:60] for p in make_prompts(config.vocab_size, seed=4, lengths=(1, 60))]
    max_tokens = [rng.randint(8, 16) for _ in range(NUM_PROMPTS)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eos = list(config.eos_token_ids)

    @torch.inference_mode()
    def reference(prompt: list[int], new_tokens: int) -> list[int]:
        # One prompt at a time: exact (no padding), and the tiny model makes it cheap.
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                          temperature=None, top_p=None, top_k=None)
        return out[0, len(prompt):].tolist()

    return {
        "plain": plain, "shared": shared, "max_tokens": max_tokens,
        "plain_ref": [reference(p, m) for p, m in zip(plain, max_tokens, strict=True)],
        "shared_ref": [reference(p, m) for p, m in zip(shared, max_tokens, strict=True)],
    }


def greedy(max_tokens: list[int], n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(n=n, temperature=0.0, max_tokens=m) for m in max_tokens]


def token_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("seed", 0)
    return LLM(model=model_dir, dtype="float32", device="cpu", **kwargs)


def stat(llm: LLM, name: str) -> int:
    stats = llm.stats()
    return stats[name] if isinstance(stats, dict) else getattr(stats, name)


def first_outputs(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def assert_same_tokens(got: list[list[int]], expected: list[list[int]]) -> None:
    mismatched = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert not mismatched, f"prompts {mismatched} differ; first: {got[mismatched[0]]} vs " \
                           f"{expected[mismatched[0]]}"


def test_one_at_a_time(tiny_model_dir: str, workload: dict[str, Any]) -> None:
    llm = make_llm(tiny_model_dir)
    got = []
    for prompt, params in zip(workload["plain"], greedy(workload["max_tokens"]), strict=True):
        (output,) = llm.generate(token_prompts([prompt]), params, use_tqdm=False)
        got.append(output.outputs[0].token_ids)
    assert_same_tokens(got, workload["plain_ref"])


def test_all_at_once(tiny_model_dir: str, workload: dict[str, Any]) -> None:
    llm = make_llm(tiny_model_dir)
    outputs = llm.generate(token_prompts(workload["plain"]), greedy(workload["max_tokens"]),
                           use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == workload["plain"]  # input order kept
    assert_same_tokens(first_outputs(outputs), workload["plain_ref"])
    for output, ref in zip(outputs, workload["plain_ref"], strict=True):
        assert output.outputs[0].finish_reason in ("stop", "length")
        assert len(output.outputs[0].token_ids) == len(ref)


def test_chunked_prefill(tiny_model_dir: str, workload: dict[str, Any]) -> None:
    # Every prompt longer than 16 tokens is prefilled in chunks of at most 16.
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    outputs = llm.generate(token_prompts(workload["plain"]), greedy(workload["max_tokens"]),
                           use_tqdm=False)
    assert_same_tokens(first_outputs(outputs), workload["plain_ref"])


def test_preemption(tiny_model_dir: str, workload: dict[str, Any]) -> None:
    # 24 blocks of 16 = 384 slots: far less than 32 prompts of ~100 tokens need at once.
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=24, block_size=16)
    outputs = llm.generate(token_prompts(workload["plain"]), greedy(workload["max_tokens"]),
                           use_tqdm=False)
    assert stat(llm, "num_preemptions") > 0
    assert_same_tokens(first_outputs(outputs), workload["plain_ref"])


def test_shared_system_prompt_hits_the_prefix_cache(tiny_model_dir: str,
                                                    workload: dict[str, Any]) -> None:
    llm = make_llm(tiny_model_dir, block_size=8)
    params = greedy(workload["max_tokens"])
    prompts = token_prompts(workload["shared"])
    first = llm.generate(prompts[:1], params[:1], use_tqdm=False)  # registers the system blocks
    rest = llm.generate(prompts[1:], params[1:], use_tqdm=False)
    assert stat(llm, "prefix_hits") > 0
    assert all(o.num_cached_tokens >= SYSTEM_PROMPT_LEN // 8 * 8 for o in rest)
    assert_same_tokens(first_outputs(first + rest), workload["shared_ref"])


def test_parallel_sampling_n2(tiny_model_dir: str, workload: dict[str, Any]) -> None:
    llm = make_llm(tiny_model_dir)
    outputs = llm.generate(token_prompts(workload["plain"]), greedy(workload["max_tokens"], n=2),
                           use_tqdm=False)
    for output in outputs:
        assert len(output.outputs) == 2
    assert_same_tokens([o.outputs[1].token_ids for o in outputs], workload["plain_ref"])
    assert_same_tokens(first_outputs(outputs), workload["plain_ref"])


def test_seeded_sampling_ignores_batch_mates_and_preemption(tiny_model_dir: str,
                                                             workload: dict[str, Any]) -> None:
    prompts = token_prompts(workload["plain"][:8])
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=12) for i in range(8)]
    alone = [make_llm(tiny_model_dir).generate(p, s, use_tqdm=False)[0].outputs[0].token_ids
             for p, s in zip(prompts[:2], seeded[:2], strict=True)]
    # Batched with unseeded mates, in a pool small enough to preempt.
    crowded = make_llm(tiny_model_dir, num_gpu_blocks_override=14, block_size=16, seed=9)
    outputs = crowded.generate(prompts, seeded[:2] + [SamplingParams(temperature=1.0, max_tokens=12)] * 6,
                               use_tqdm=False)
    assert stat(crowded, "num_preemptions") > 0
    assert first_outputs(outputs)[:2] == alone


def test_string_prompt_text_and_logprobs(tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    llm = make_llm(tiny_model_dir)
    (output,) = llm.generate("the quick brown fox", SamplingParams(temperature=0.0, max_tokens=6,
                                                                   logprobs=2), use_tqdm=False)
    completion = output.outputs[0]
    assert output.prompt_token_ids == tokenizer("the quick brown fox")["input_ids"]
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for token, logprobs in zip(completion.token_ids, completion.logprobs, strict=True):
        assert logprobs.top[0][0] == token  # greedy: the chosen token is the most likely
        assert logprobs.logprob == logprobs.top[0][1] <= 0.0
