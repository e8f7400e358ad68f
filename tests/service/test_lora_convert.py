"""The adapter on the wire: Engine GenerateRequest, the worker's NewRequest, Init's LoRA limits."""

import pytest

from pagoda.contract import worker_codec
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.lora import LoRARequest
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import NewRequestData, StepPlan, WorkerInfo
from pagoda.v1 import engine_pb2
from scheduler_svc import convert as engine_convert
from scheduler_svc.core.request import EngineRequest

LORA = LoRARequest("sql", 3, "/adapters/sql")


@pytest.mark.parametrize("lora", [LORA, None])
def test_new_request_carries_its_adapter(lora):
    new = NewRequestData(RequestId("r"), [1, 2], 2, [BlockId(4)], 0, 2, SamplingParams(), lora=lora)
    _, plan = worker_codec.plan_from_pb(worker_codec.plan_to_pb(StepPlan(step_id=1, new_requests=[new]), 7))
    assert plan.new_requests[0].lora == lora


@pytest.mark.parametrize("lora", [LORA, None])
def test_engine_request_carries_its_adapter(lora):
    request = EngineRequest(RequestId("r"), (1, 2), SamplingParams(max_tokens=None), lora=lora)
    pb = engine_convert.request_to_pb(request)
    assert pb.HasField("lora") == (lora is not None)
    assert engine_convert.request_from_pb(pb, 0.0).lora == lora


def test_a_nameless_adapter_is_a_400():
    pb = engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1])
    pb.lora.lora_path = "/x"
    with pytest.raises(InvalidRequestError):
        engine_convert.request_from_pb(pb, 0.0)


def test_init_reports_the_lora_limits():
    info = WorkerInfo(10, 16, 128, (2,), 256, "m", max_loras=4, max_lora_rank=16)
    assert worker_codec.info_from_pb(worker_codec.info_to_pb(info, 5)) == (5, info)
