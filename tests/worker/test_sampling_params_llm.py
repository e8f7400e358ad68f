"""Every sampling parameter the API accepts, through the real runner (`LLM` on the tiny model), each
next to a plain greedy request that must come out exactly as it does alone.

The sampler's own tests (test_sampler.py) use ordinary tensors; here the logits are the runner's
(made under inference mode), which is where in-place penalties once failed.
"""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams

PARAMS = {
    "repetition_penalty": dict(temperature=0.0, repetition_penalty=2.0),
    "presence_penalty": dict(temperature=0.0, presence_penalty=2.0),
    "frequency_penalty": dict(temperature=0.0, frequency_penalty=2.0),
    "penalties_sampled": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5,
                              repetition_penalty=1.2, seed=3),
    "min_tokens": dict(temperature=0.0, min_tokens=6),
    "top_k_top_p_min_p": dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05, seed=5),
    "logprobs": dict(temperature=0.0, logprobs=3),
    "stop_token_ids": dict(temperature=0.0, ignore_eos=True),
}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str):
    with LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> tuple[list[int], list[int]]:
    rng = random.Random(0)
    vocab = llm.worker_info.vocab_size
    return ([rng.randrange(10, vocab) for _ in range(12)], [rng.randrange(10, vocab) for _ in range(9)])


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("name", PARAMS)
def test_every_parameter_works_and_leaves_its_batch_mate_alone(llm: LLM, prompts, name: str) -> None:
    mine, mate = prompts
    alone = llm.generate([{"prompt_token_ids": mate}], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    kwargs = dict(PARAMS[name])
    if name == "stop_token_ids":
        first = llm.generate([{"prompt_token_ids": mine}], _greedy(1), use_tqdm=False)[0].outputs[0].token_ids[0]
        kwargs["stop_token_ids"] = [first]
        kwargs["min_tokens"] = 4  # the stop token is masked for 4 tokens, then allowed
    params = SamplingParams(max_tokens=MAX_TOKENS, **kwargs)
    out, mate_out = llm.generate([{"prompt_token_ids": mine}, {"prompt_token_ids": mate}],
                                 [params, _greedy()], use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert mate_out.outputs[0].token_ids == alone
    assert 1 <= len(tokens) <= MAX_TOKENS
    # greedy or seeded: its own tokens do not depend on its batch mate either
    assert llm.generate([{"prompt_token_ids": mine}], params, use_tqdm=False)[0].outputs[0].token_ids == tokens
    if name == "min_tokens":
        assert len(tokens) >= 6
    if name == "stop_token_ids":
        assert kwargs["stop_token_ids"][0] not in tokens[:4]
    if name == "logprobs":
        assert len(out.outputs[0].logprobs) == len(tokens)
