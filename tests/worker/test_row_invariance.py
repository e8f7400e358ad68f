"""A token's logits are the same bits however its step was made up (issue 32): alone, beside
other sequences, prefilled in one chunk or decoded one token at a time. This is what lets a
failover continuation (prompt + streamed tokens, prefilled on another replica) and a request
batched differently continue a greedy stream exactly.

The case is request 4,098 of the 10k fault soak (benchmarks/soak_requests.py, seed 0), tiny
model, fp32: at its 4th token the top two logits (46 and 349) are 6e-7 apart, so a last-bit
difference picks the other one. Before the fix, steps over 64 rows ran the module loop and
smaller ones the fused op (worker_svc/models/fused_decode.py); the two differ in the last bits
and the module loop's element-wise ops also vary with the step's row count, so the soak's
continuation got "WhificianastK twice On slow" where the undisturbed stream got
"WhificianK twiceKunday slow".
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kernels.cpu_extension import toolchain_available
from pagoda import LLM, SamplingParams
from pagoda.contract.ids import RequestId
from scheduler_svc.core import EngineRequest
from tests.worker.test_fused_decode import BLOCK, build, meta

pytestmark = pytest.mark.skipif(not toolchain_available(), reason="no C++ toolchain for the compiled ops")

PROMPT = [612, 790, 691, 20, 220, 445, 181, 137, 948, 71, 287, 940, 654, 242, 522, 432, 368, 744, 948, 368,
          130, 913, 382, 99]  # soak request 4,098
GREEDY = [1065, 509, 973, 46, 775, 46, 666, 460]  # its undisturbed output
_request_ids = itertools.count()
OTHERS = [[(7 * i + 13 * j) % 1000 + 2 for j in range(24)] for i in range(3)]  # three more 24-token prompts


@torch.inference_mode()
def last_logits(model, cfg, steps: list[list[list[int]]]) -> torch.Tensor:
    """Run `steps` (each a list of sequences' new tokens; sequence 0 is the one watched, the
    others start at step 0) on a fresh cache; the logits of sequence 0's last row of the last step."""
    seqs = max(len(step) for step in steps)
    per_seq = 4
    tables = torch.arange(seqs * per_seq, dtype=torch.int32).view(seqs, per_seq)
    shape = (seqs * per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    done = [0] * seqs
    for step in steps:
        ids = torch.tensor([t for new in step for t in new])
        positions = torch.cat([torch.arange(done[i], done[i] + len(new)) for i, new in enumerate(step)])
        lens = [done[i] + len(new) for i, new in enumerate(step)]
        hidden = model(ids, positions, meta(lens, [len(new) for new in step], tables[:len(step)]), caches)
        done[:len(step)] = lens
    return model.compute_logits(hidden[len(steps[-1][0]) - 1:len(steps[-1][0])])[0]


def test_a_tokens_logits_do_not_depend_on_the_step(tiny_model_dir):
    model, cfg, fused = build(tiny_model_dir, torch.float32, None)
    model.fused_decode = fused  # as the CPU worker runs it
    context = PROMPT + GREEDY[:3]
    ways = {
        "decoded one at a time": last_logits(model, cfg, [[PROMPT]] + [[[t]] for t in GREEDY[:3]]),
        "one chunk, alone": last_logits(model, cfg, [[context]]),
        "one chunk beside 3 prompts (99 rows)": last_logits(model, cfg, [[context] + OTHERS]),
        "prompt beside 3 prompts, then decoded beside them": last_logits(
            model, cfg, [[PROMPT] + OTHERS] + [[[t], [5], [6], [7]] for t in GREEDY[:3]]),
    }
    reference = ways.pop("decoded one at a time")
    assert reference.argmax().item() == GREEDY[3]
    assert 0 <= (reference[46] - reference[349]).item() < 2e-6  # the near-tie that flipped
    for way, logits in ways.items():
        assert torch.equal(logits, reference), way


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str):
    with LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=512,
             enable_prefix_caching=False) as engine:
        yield engine


def _run(llm: LLM, requests: list[tuple[list[int], SamplingParams, int]]) -> list[list[int]]:
    ids = [RequestId(f"ri-{next(_request_ids)}") for _ in requests]
    for rid, (prompt, sampling, prior) in zip(ids, requests, strict=True):
        llm.scheduler.add_request(EngineRequest(rid, tuple(prompt), sampling, num_prior_output_tokens=prior))
    out: dict[RequestId, list[int]] = {rid: [] for rid in ids}
    while llm.scheduler.has_unfinished_requests():
        for delta in llm.scheduler.update(llm.runner.execute(llm.scheduler.schedule())):
            out[delta.request_id] += delta.new_token_ids
    return [out[rid] for rid in ids]


def test_soak_request_4098_continues_exactly_from_every_token(llm):
    """Alone, in a batch, and as a failover continuation at every k (all seven prefilled in one
    196-row step): the same eight greedy tokens."""
    sampling = SamplingParams(max_tokens=len(GREEDY), temperature=0.0, ignore_eos=True)
    assert _run(llm, [(PROMPT, sampling, 0)]) == [GREEDY]
    assert _run(llm, [(PROMPT, sampling, 0)] + [(p, sampling, 0) for p in OTHERS])[0] == GREEDY
    ks = range(1, len(GREEDY))
    rests = _run(llm, [(PROMPT + GREEDY[:k], dataclasses.replace(sampling, max_tokens=len(GREEDY) - k), k)
                       for k in ks])
    assert rests == [GREEDY[k:] for k in ks]
