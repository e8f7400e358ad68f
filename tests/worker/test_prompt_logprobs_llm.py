"""Prompt logprobs (SamplingParams.prompt_logprobs) of the offline LLM equal HF transformers'
fp32 log-softmax over the prompt within 1e-4 — the logprob of every prompt token, its rank and
the top k — whatever the chunking, batch mix, prefix-cache state, preemption, n or speculation."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.contract.errors import InvalidRequestError
from tests.worker.hf_models import build_hf_model
from worker_svc.model_loader.model_config import ModelConfig

TOLERANCE = 1e-4
TOP_K = 5


def hf_log_softmax(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """[len(prompt), vocab] fp32 log-softmax of HF's logits, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def assert_matches_hf(prompt: list[int], got: list, expected: torch.Tensor, top_k: int = TOP_K) -> None:
    """`got` (RequestOutput.prompt_logprobs) against HF's log-softmax rows of `prompt`."""
    assert len(got) == len(prompt), "one entry per prompt token, no more (no duplicates), no less"
    assert got[0] is None
    for i in range(1, len(prompt)):
        row, token, entry = expected[i - 1], prompt[i], got[i]  # row i-1 predicts token i
        want = row[token].item()
        assert abs(entry.logprob - want) < TOLERANCE, (i, entry.logprob, want)
        # The rank, up to ties within the tolerance: 1 + the tokens more likely than this one.
        assert int((row > want + 1e-5).sum()) + 1 <= entry.rank <= int((row > want - 1e-5).sum()) + 1
        hf_values, hf_ids = row.topk(top_k)
        assert len(entry.top) == top_k
        # HF's top k, up to the order of near-ties: the same values, each at a token HF gives it.
        for (token_id, value), hf_value in zip(entry.top, hf_values.tolist(), strict=True):
            assert abs(value - hf_value) < TOLERANCE and abs(row[token_id].item() - value) < TOLERANCE
        assert sum(t == h for (t, _), h in zip(entry.top, hf_ids.tolist(), strict=True)) >= top_k - 1


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model=model_dir, dtype="float32", device="cpu", seed=0, **kwargs)


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: str) -> list[list[int]]:
    """Lengths 1, 2, 17, 40 and 150: one token (nothing to report), one block, several blocks,
    and longer than every prefill chunk below."""
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    rng = random.Random(5)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in (1, 2, 17, 40, 150)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    return hf_log_softmax(tiny_model_dir, prompts)


@pytest.mark.parametrize("engine", [
    {},  # every prompt in one step
    {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 16},  # chunks of at most 16
    {"max_num_batched_tokens": 48, "long_prefill_token_threshold": 7, "block_size": 8},  # odd chunks
], ids=["whole", "chunks16", "chunks7"])
def test_prompt_logprobs_equal_hf(tiny_model_dir: str, prompts, reference, engine) -> None:
    llm = make_llm(tiny_model_dir, **engine)
    outputs = llm.generate(token_prompts(prompts), SamplingParams(prompt_logprobs=TOP_K, max_tokens=1),
                           use_tqdm=False)
    for prompt, output, expected in zip(prompts, outputs, reference, strict=True):
        assert_matches_hf(prompt, output.prompt_logprobs, expected)
        assert output.outputs[0].logprobs is None  # sampled logprobs were not asked for


def test_a_prefix_cache_hit_does_not_lose_them(tiny_model_dir: str, prompts, reference) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    long_prompt, expected = prompts[-1], reference[-1]
    asking = SamplingParams(prompt_logprobs=TOP_K, max_tokens=2, temperature=0.0)
    first = llm.generate(token_prompts([long_prompt]), asking, use_tqdm=False)[0]
    hits_before = llm.stats().prefix_hits
    again = llm.generate(token_prompts([long_prompt]), asking, use_tqdm=False)[0]
    # The cached blocks are skipped for a request that asks: it computes its whole prompt.
    assert again.num_cached_tokens == 0 and llm.stats().prefix_hits == hits_before
    assert_matches_hf(long_prompt, again.prompt_logprobs, expected)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # The cache was there: a request that does not ask hits it.
    plain = llm.generate(token_prompts([long_prompt]), SamplingParams(max_tokens=2, temperature=0.0),
                         use_tqdm=False)[0]
    assert plain.num_cached_tokens == 144 and plain.prompt_logprobs is None  # 9 full blocks of 16


def test_preemption_reports_each_position_once(tiny_model_dir: str, prompts, reference) -> None:
    # 24 blocks of 8 (192 slots) for four sequences of up to 150 + 40 tokens: preempted, resumed,
    # prompts recomputed (and reported again by the worker) — each position is handed out once.
    llm = make_llm(tiny_model_dir, block_size=8, num_gpu_blocks_override=24, max_num_batched_tokens=32,
                   long_prefill_token_threshold=16)
    chosen = [prompts[2], prompts[3], prompts[4], prompts[3]]
    params = SamplingParams(prompt_logprobs=2, max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(token_prompts(chosen), params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    by_prompt = {id(p): e for p, e in zip(prompts, reference, strict=True)}
    for prompt, output in zip(chosen, outputs, strict=True):
        assert_matches_hf(prompt, output.prompt_logprobs, by_prompt[id(prompt)], top_k=2)


def test_n2_and_sampled_logprobs_together(tiny_model_dir: str, prompts, reference) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    params = SamplingParams(n=2, prompt_logprobs=0, logprobs=1, max_tokens=3, seed=1)
    output = llm.generate(token_prompts([prompts[3]]), params, use_tqdm=False)[0]
    # Once for the request, not per sequence; k = 0: the prompt token alone, no alternatives.
    assert_matches_hf(prompts[3], output.prompt_logprobs, reference[3], top_k=0)
    assert [len(c.logprobs) for c in output.outputs] == [3, 3]


def test_with_speculative_decoding(tiny_model_dir: str, prompts, reference) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    repetitive = prompts[3][:10] * 4  # n-gram drafts find matches in it
    outputs = llm.generate(token_prompts([repetitive, prompts[4]]),
                           SamplingParams(prompt_logprobs=TOP_K, max_tokens=12, temperature=0.0),
                           use_tqdm=False)
    assert_matches_hf(repetitive, outputs[0].prompt_logprobs, hf_log_softmax(tiny_model_dir, [repetitive])[0])
    assert_matches_hf(prompts[4], outputs[1].prompt_logprobs, reference[4])


@pytest.mark.parametrize("bad", [-1, 21])
def test_out_of_range_is_refused(bad: int) -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=bad)


@pytest.mark.slow
def test_tensor_parallel_2(tiny_model_dir: str, prompts, reference) -> None:
    with make_llm(tiny_model_dir, tensor_parallel_size=2, max_num_batched_tokens=64,
                  long_prefill_token_threshold=16) as llm:
        outputs = llm.generate(token_prompts(prompts), SamplingParams(prompt_logprobs=TOP_K, max_tokens=1),
                               use_tqdm=False)
    for prompt, output, expected in zip(prompts, outputs, reference, strict=True):
        assert_matches_hf(prompt, output.prompt_logprobs, expected)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_other_architectures(tmp_path_factory: pytest.TempPathFactory, kind: str) -> None:
    model_dir = str(build_hf_model(kind, tmp_path_factory.mktemp(kind)))
    rng = random.Random(11)
    chosen = [[rng.randrange(3, 256) for _ in range(n)] for n in (9, 70)]
    llm = make_llm(model_dir, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    outputs = llm.generate(token_prompts(chosen), SamplingParams(prompt_logprobs=TOP_K, max_tokens=1),
                           use_tqdm=False)
    for prompt, output, expected in zip(chosen, outputs, hf_log_softmax(model_dir, chosen), strict=True):
        assert_matches_hf(prompt, output.prompt_logprobs, expected)
