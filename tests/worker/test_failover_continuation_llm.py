"""A mid-stream failover's continuation through the real runner (the tiny model, CPU): the prompt
plus the output already streamed, marked `num_prior_output_tokens`, max_tokens / min_tokens
reduced, samples exactly the rest of the original output, for greedy and seeded streams with
penalties and min_tokens (the sampler's seeded draw depends on (seed, seq_index, output position),
and penalties count output tokens only: both must see the earlier output as output).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.contract.ids import RequestId
from scheduler_svc.core import EngineRequest

MAX_TOKENS = 16
CASES = {
    "greedy_penalties": dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3),
    "seeded_penalties_min_tokens": dict(temperature=1.0, seed=11, presence_penalty=0.5, frequency_penalty=0.7,
                                        repetition_penalty=1.2, min_tokens=10),
    "seeded_top_k_top_p": dict(temperature=0.9, top_k=20, top_p=0.9, seed=5),
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str):
    with LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=256) as engine:
        yield engine


def _run(llm: LLM, request: EngineRequest) -> list[int]:
    llm.scheduler.add_request(request)
    tokens: list[int] = []
    while llm.scheduler.has_unfinished_requests():
        for delta in llm.scheduler.update(llm.runner.execute(llm.scheduler.schedule())):
            tokens += delta.new_token_ids
    return tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_continuation_samples_the_rest_of_the_original(llm, case):
    vocab = llm.worker_info.vocab_size
    prompt = tuple(random.Random(case).randrange(10, vocab) for _ in range(12))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **CASES[case])
    original = _run(llm, EngineRequest(RequestId(f"{case}-a"), prompt, sampling))
    assert len(original) == MAX_TOKENS
    for prior in (1, 6):
        rest = dataclasses.replace(sampling, max_tokens=MAX_TOKENS - prior,
                                   min_tokens=max(0, sampling.min_tokens - prior))
        carried = _run(llm, EngineRequest(RequestId(f"{case}-c{prior}"), prompt + tuple(original[:prior]), rest,
                                          num_prior_output_tokens=prior))
        assert carried == original[prior:], prior


def test_without_the_earlier_output_marked_a_seeded_continuation_differs(llm):
    """The check above has teeth: the same continuation as a plain prompt draws other tokens."""
    vocab = llm.worker_info.vocab_size
    prompt = tuple(random.Random(1).randrange(10, vocab) for _ in range(12))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=11)
    original = _run(llm, EngineRequest(RequestId("p-a"), prompt, sampling))
    plain = _run(llm, EngineRequest(RequestId("p-c"), prompt + tuple(original[:6]),
                                    dataclasses.replace(sampling, max_tokens=MAX_TOKENS - 6)))
    assert plain != original[6:]
