"""Round trips of both codecs: protobuf -> dataclass -> protobuf (and back) loses nothing."""

from __future__ import annotations

import pytest

from pagoda.contract import worker_codec as convert
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from pagoda.contract.step import (
    BlockCopy,
    Embedding,
    Fork,
    ModelDraft,
    NewRequestData,
    PromptLogprobs,
    StepPlan,
    StepResult,
    TableUpdate,
    TokenLogprobs,
    WorkerInfo,
)
from pagoda.v1 import common_pb2, engine_pb2, worker_pb2
from scheduler_svc import convert as engine_convert
from scheduler_svc.core.outputs import SchedulerStats, SequenceDelta, TenantStats
from scheduler_svc.core.request import EngineRequest

FULL_SAMPLING = SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, max_tokens=9,
                               min_tokens=2, stop_token_ids=(3, 4), ignore_eos=True, logprobs=2,
                               presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=None), SamplingParams(), FULL_SAMPLING,
                                    SamplingParams(temperature=0.0, seed=0, logprobs=0),
                                    SamplingParams(prompt_logprobs=0), SamplingParams(prompt_logprobs=20)])
def test_sampling_round_trip(params):
    assert convert.sampling_from_pb(convert.sampling_to_pb(params)) == params


def test_empty_sampling_message_means_vllm_defaults_without_a_token_limit():
    params = convert.sampling_from_pb(common_pb2.SamplingParams())
    assert params == SamplingParams(max_tokens=None)


def test_bad_sampling_raises_invalid_request():
    with pytest.raises(InvalidRequestError, match="temperature"):
        convert.sampling_from_pb(common_pb2.SamplingParams(temperature=-1.0))


def make_plan() -> StepPlan:
    return StepPlan(
        step_id=12,
        new_requests=[NewRequestData("a", [1, 2, 3, 4, 5], 4, [7, 8], 2, 3, FULL_SAMPLING, seq_index=1)],
        finished_ids=["f1", "f2"], preempted_ids=["p"],
        table_updates=[TableUpdate("r", 3, [9]), TableUpdate("s", 0, [1, 2])],
        num_scheduled_tokens={"r": 0, "s": 5}, block_copies=[BlockCopy(4, 5)],
        forks=[Fork("a", ["a#1", "a#2"])], traceparent="00-abc-def-01",
        swap_out=[BlockCopy(3, 0), BlockCopy(6, 1)], swap_in=[BlockCopy(2, 11)],
        model_drafts=[ModelDraft("s", 4, 17, 2, [30, 31])])


def test_plan_round_trip_carries_the_epoch():
    plan = make_plan()
    pb = convert.plan_to_pb(plan, epoch=99)
    epoch, back = convert.plan_from_pb(worker_pb2.StepPlan.FromString(pb.SerializeToString()))
    assert (epoch, back) == (99, plan)


def test_result_round_trip_with_and_without_logprobs():
    plain = StepResult(3, ["a", "b"], [10, 11], [], 0.25, 0.5)
    assert convert.result_from_pb(convert.result_to_pb(plain)) == plain
    with_lp = StepResult(4, ["a"], [10], [TokenLogprobs(-0.5, [(10, -0.5), (2, -1.5)])])
    assert convert.result_from_pb(convert.result_to_pb(with_lp)) == with_lp


def test_worker_info_round_trip():
    info = WorkerInfo(100, 16, 2048, (2, 3), 32000, "tiny", num_cpu_blocks=40, sliding_window=4096)
    assert convert.info_from_pb(convert.info_to_pb(info, epoch=5)) == (5, info)


def test_engine_request_round_trip():
    request = EngineRequest("r1", (1, 2, 3), FULL_SAMPLING, arrival_time=1.5, priority=-2, cache_salt="t",
                            tenant="team-a", kv_share=0.25)
    pb = engine_convert.request_to_pb(request)
    assert engine_convert.request_from_pb(pb, arrival_time=1.5) == request


def test_stats_carry_the_tenants_figures():
    core = SchedulerStats(*([0] * 15), tenants=(TenantStats("team-a", 12, 16, 900, 300, 5, 1500.0),
                                                TenantStats("", 3, 64, 40, 8, 0, 56.0)))
    pb = engine_convert.stats_to_pb(core, num_total_blocks=64, num_steps=1, idle=False, invariant_ok=True,
                                    request_success={}, worker_connected=True, step_seconds_sum=0.0)
    assert (dict(pb.tenant_blocks_held), dict(pb.tenant_blocks_cap), dict(pb.tenant_prompt_tokens),
            dict(pb.tenant_generation_tokens), dict(pb.tenant_requests_waiting), dict(pb.tenant_virtual_tokens)) == \
        ({"team-a": 12, "": 3}, {"team-a": 16, "": 64}, {"team-a": 900, "": 40}, {"team-a": 300, "": 8},
         {"team-a": 5, "": 0}, {"team-a": 1500.0, "": 56.0})


def test_empty_request_id_gets_a_fresh_one():
    first = engine_convert.request_from_pb(engine_pb2.GenerateRequest(prompt_token_ids=[1]), 0.0)
    second = engine_convert.request_from_pb(engine_pb2.GenerateRequest(prompt_token_ids=[1]), 0.0)
    assert first.request_id.startswith("req-") and first.request_id != second.request_id


@pytest.mark.parametrize("reason", [None, *FinishReason])
def test_delta_round_trip(reason):
    delta = SequenceDelta("r", 1, [5, 6], [TokenLogprobs(-0.1), TokenLogprobs(-0.2, [(6, -0.2)])], reason)
    assert engine_convert.delta_from_pb(engine_convert.delta_to_pb(delta), "r") == delta


def test_response_carries_prompt_and_cache_counts_of_the_deltas():
    delta = SequenceDelta("r", 0, [5], [], FinishReason.STOP, num_prompt_tokens=7, num_cached_tokens=4)
    pb = engine_convert.response_to_pb("r", [delta], finished=True, queue_seconds=0.5)
    assert (pb.num_prompt_tokens, pb.num_cached_tokens, pb.finished, pb.queue_seconds) == (7, 4, True, 0.5)
    assert pb.sequences[0].finish_reason == common_pb2.FINISH_REASON_STOP


def test_result_round_trip_with_prompt_logprobs():
    result = StepResult(5, ["a"], [10], prompt_logprobs=[
        PromptLogprobs("a", 1, [TokenLogprobs(-0.5, [(3, -0.25)], rank=2), TokenLogprobs(-0.1, rank=1)]),
        PromptLogprobs("b", 17, [TokenLogprobs(-3.0, rank=40)])])
    pb = worker_pb2.StepResult.FromString(convert.result_to_pb(result).SerializeToString())
    assert convert.result_from_pb(pb) == result


def test_response_carries_the_prompt_logprobs_of_its_first_sequence():
    prompt = [TokenLogprobs(-1.5, [(4, -1.0)], rank=3), TokenLogprobs(-0.5, rank=1)]
    deltas = [SequenceDelta("r", 0, [5], prompt_logprobs=prompt), SequenceDelta("r", 1, [6])]
    pb = engine_convert.response_to_pb("r", deltas, finished=False)
    assert [engine_convert.logprobs_from_pb(lp) for lp in pb.prompt_logprobs] == prompt
    assert not engine_convert.response_to_pb("r", deltas[1:], finished=False).prompt_logprobs


def test_pooling_round_trips_and_its_embedding_reaches_the_response():
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=True)
    assert convert.sampling_from_pb(convert.sampling_to_pb(params)) == params
    result = StepResult(step_id=3, embeddings=[Embedding(RequestId("e"), [0.25, -0.5])])
    pb = worker_pb2.StepResult.FromString(convert.result_to_pb(result).SerializeToString())
    assert convert.result_from_pb(pb) == result  # 0.25 and -0.5 are exact in float32
    delta = SequenceDelta(RequestId("e"), 0, [7], finish_reason=FinishReason.LENGTH, embedding=[0.25, -0.5])
    assert list(engine_convert.response_to_pb("e", [delta], finished=True).embedding) == [0.25, -0.5]
    with pytest.raises(InvalidRequestError):
        SamplingParams(n=2, pooling=True)
