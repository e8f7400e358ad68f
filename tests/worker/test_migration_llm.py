"""Live migration through the real runner (the tiny model, fp32, CPU): two offline engines sharing
one migration folder play the source and the target replica. A request exported mid-stream by the
source (its KV written as block files) resumes on the target from the files: 0 prefill tokens
computed there, and its tokens equal the undisturbed run's, greedy and seeded. A file from another
model, or one holding other tokens, is refused (the plan fails before anything changed)."""

from __future__ import annotations

import pytest

from pagoda import LLM
from pagoda.contract.errors import PlanError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from scheduler_svc.core import EngineRequest

PROMPT = tuple((i * 37) % 1900 + 20 for i in range(75))  # 4 full blocks of 16 and a partial one
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engines(tiny_model_dir: str, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("migrate"))
    with LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=64,
             kv_migrate_dir=folder) as source, \
         LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=64,
             kv_migrate_dir=folder) as target:
        yield source, target


def _request(rid: str, prompt=PROMPT, max_tokens=MAX_TOKENS, prior=0, handoff=None, **sampling):
    return EngineRequest(RequestId(rid), tuple(prompt),
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
                         num_prior_output_tokens=prior, kv_import=handoff)


def _step(llm: LLM):
    return llm.scheduler.update(llm.runner.execute(llm.scheduler.schedule()))


def _run(llm: LLM, request: EngineRequest, stop_after: int | None = None):
    """Its tokens (all, or the first `stop_after`), the finish reason and the migration handoff."""
    llm.scheduler.add_request(request)
    tokens: list[int] = []
    while True:
        for delta in _step(llm):
            tokens += delta.new_token_ids
            if delta.finish_reason is not None:
                return tokens, delta.finish_reason, delta.migration
        if stop_after is not None and len(tokens) >= stop_after:
            return tokens, None, None


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}],
                         ids=["greedy", "seeded"])
def test_migrated_request_resumes_from_files_token_identical(engines, sampling):
    source, target = engines
    expected, reason, _ = _run(source, _request(f"ref-{len(sampling)}", **sampling))
    assert reason is FinishReason.LENGTH and len(expected) == MAX_TOKENS

    rid = f"mig-{len(sampling)}"
    streamed, _, _ = _run(source, _request(rid, **sampling), stop_after=6)
    assert source.scheduler.export_request(RequestId(rid), f"m{len(sampling)}") == []
    deltas = _step(source)
    assert [d.finish_reason for d in deltas] == [FinishReason.MIGRATED]
    handoff = deltas[0].migration
    # 75 prompt + 6 streamed tokens, all computed but the last (synchronous loop: nothing in flight)
    assert (handoff.num_tokens, handoff.num_blocks) == (80, 5)
    assert source.scheduler.stats().num_used_blocks == 0
    source.scheduler.check_invariants()

    before = target.scheduler.stats().prefill_tokens_computed
    rest, reason, _ = _run(target, _request(rid, PROMPT + tuple(streamed), MAX_TOKENS - len(streamed),
                                            prior=len(streamed), handoff=handoff, **sampling))
    assert target.scheduler.stats().prefill_tokens_computed == before  # the context came from the files
    assert reason is FinishReason.LENGTH and streamed + rest == expected


def test_a_file_with_other_tokens_is_refused(engines):
    source, target = engines
    streamed, _, _ = _run(source, _request("bad"), stop_after=2)
    source.scheduler.export_request(RequestId("bad"), "mbad")
    handoff = _step(source)[0].migration
    wrong = (PROMPT[0] + 1,) + PROMPT[1:] + tuple(streamed)  # its first block differs from the file's
    target.scheduler.add_request(_request("bad", wrong, MAX_TOKENS - 2, prior=2, handoff=handoff))
    with pytest.raises(PlanError, match="other tokens"):
        target.runner.execute(target.scheduler.schedule())
