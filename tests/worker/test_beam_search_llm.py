"""Beam search inside the engine against HF transformers' `generate(num_beams=W, do_sample=False,
early_stopping=True, num_return_sequences=W)`: the same beams (tokens and cumulative logprobs)
for generated Llama and Qwen2 models, fp32, also in a pool so small that groups preempt each
other; beams share their blocks; the scheduler's invariant holds after every step."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagoda import LLM, SamplingParams
from pagoda.entrypoints.beam_search import BeamSearchParams
from scheduler_svc.core.request import EngineRequest
from tests.worker.hf_models import VOCAB, build_hf_model

NUM_PROMPTS = 16
MAX_TOKENS = 10
EOS = 2  # hf_models' eos_token_id
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel]:
    out = build_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return str(out), hf


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(NUM_PROMPTS)]


@torch.inference_mode()
def hf_beams(hf, prompt: list[int], width: int, stops: list[int]) -> list[tuple[list[int], float]]:
    """HF's beams, best first: (output tokens up to and including the stop token, cum logprob)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                      early_stopping=True, num_return_sequences=width, max_new_tokens=MAX_TOKENS,
                      eos_token_id=stops, pad_token_id=stops[0], length_penalty=1.0,
                      output_scores=True, return_dict_in_generate=True,
                      temperature=None, top_p=None, top_k=None)
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores, strict=True):
        tokens = sequence[len(prompt):].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))  # padding after
        beams.append((tokens[:end], float(score) * end))  # score = cum_logprob / length
    return beams


def run_checked(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list]:
    """llm's scheduler and runner stepped by hand, with the invariant checked after every step;
    per prompt, the (tokens, cumulative logprob) of its beams in rank order."""
    scheduler = llm.scheduler
    for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
        scheduler.add_request(EngineRequest(str(i), tuple(prompt), sampling))
    beams: dict[str, list] = {str(i): [None] * p.n for i, p in enumerate(params)}
    while scheduler.has_unfinished_requests():
        for delta in scheduler.update(llm.runner.execute(scheduler.schedule())):
            assert delta.finished and delta.new_token_ids, "beam search answers once, at the end"
            beams[delta.request_id][delta.seq_index] = (delta.new_token_ids, delta.cumulative_logprob)
        scheduler.check_invariants()
    return beams


def beam_params(width: int, stop: int | None = None) -> SamplingParams:
    return SamplingParams(n=width, beam_width=width, temperature=0.0, max_tokens=MAX_TOKENS,
                          stop_token_ids=(stop,) if stop is not None else ())


def assert_same_beams(ours: list, theirs: list, prompt: list[int]) -> None:
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs], prompt
    for (_, ours_lp), (_, hf_lp) in zip(ours, theirs, strict=True):
        assert ours_lp == pytest.approx(hf_lp, abs=1e-4)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("extra_stop", [False, True], ids=["eos", "eos+stop_token_ids"])
def test_beams_equal_hf(model, prompts, width, extra_stop):
    """With extra_stop, each prompt also stops at the third token of HF's best plain beam (random
    weights seldom say EOS): beams then end early and go through the finished hypotheses, and two
    stop tokens make it rank 3 x width candidates, as HF does."""
    model_dir, hf = model
    stops = [[EOS, hf_beams(hf, p, width, [EOS])[0][0][2]] if extra_stop else [EOS] for p in prompts]
    params = [beam_params(width, s[1] if extra_stop else None) for s in stops]
    llm = LLM(model_dir, block_size=BLOCK_SIZE, num_gpu_blocks_override=512, max_num_batched_tokens=256)
    ours = run_checked(llm, prompts, params)
    finished_early = 0
    for i, prompt in enumerate(prompts):
        theirs = hf_beams(hf, prompt, width, stops[i])
        assert_same_beams(ours[str(i)], theirs, prompt)
        finished_early += any(len(tokens) < MAX_TOKENS for tokens, _ in theirs)
    if extra_stop:
        assert finished_early >= NUM_PROMPTS // 2  # the stop tokens really ended beams
    assert llm.stats().num_used_blocks == 0


def test_cramped_pool_preempts_and_still_equals_hf(model, prompts):
    """A pool of 64 four-token blocks for 16 groups of 4 beams: groups preempt each other
    (recompute), resume whole, and return HF's beams all the same."""
    model_dir, hf = model
    width = 4
    llm = LLM(model_dir, block_size=BLOCK_SIZE, num_gpu_blocks_override=64, max_num_batched_tokens=128)
    ours = run_checked(llm, prompts, [beam_params(width)] * len(prompts))
    assert llm.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert_same_beams(ours[str(i)], hf_beams(hf, prompt, width, [EOS]), prompt)


def test_beams_share_their_blocks(model):
    """One 40-token prompt, 4 beams: at every step fewer blocks are used than 4 unshared copies."""
    model_dir, _ = model
    width, prompt = 4, list(range(20, 60))
    llm = LLM(model_dir, block_size=BLOCK_SIZE, num_gpu_blocks_override=512)
    scheduler = llm.scheduler
    scheduler.add_request(EngineRequest("r", tuple(prompt), SamplingParams(
        n=width, beam_width=width, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)))
    peak_ratio = 0.0
    while scheduler.has_unfinished_requests():
        scheduler.update(llm.runner.execute(scheduler.schedule()))
        scheduler.check_invariants()
        beams = [s for s in scheduler._queues.running if s.request.request_id == "r"]
        if len(beams) == width:
            unshared = sum(len(s.block_table) for s in beams)
            peak_ratio = max(peak_ratio, scheduler.stats().num_used_blocks / unshared)
    assert 0 < peak_ratio < 0.5  # 10 prompt blocks held once, not four times


def test_llm_beam_search_api(model, prompts):
    """vLLM's offline API: BeamSearchOutput per prompt, prompt + output tokens, best first."""
    model_dir, hf = model
    llm = LLM(model_dir, block_size=BLOCK_SIZE)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:4]],
                              BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS))
    for prompt, output in zip(prompts[:4], outputs, strict=True):
        theirs = hf_beams(hf, prompt, 2, [EOS])
        assert [s.tokens for s in output.sequences] == [prompt + tokens for tokens, _ in theirs]
        assert output.sequences[0].cum_logprob == pytest.approx(theirs[0][1], abs=1e-4)
        assert output.sequences[0].finish_reason in ("stop", "length")
