"""The Worker servicer over a fake-model runner: health, Init epochs, and plan rejection that
leaves the resident state untouched."""

from __future__ import annotations

import copy

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.contract import worker_codec as convert
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import NewRequestData, StepPlan, TableUpdate
from pagoda.runtime.grpc_health import NOT_SERVING, SERVING
from pagoda.v1 import worker_pb2
from tests.service.conftest import NUM_BLOCKS

Code = worker_pb2.StepError.Code
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


async def health_status(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def test_health_is_not_serving_until_init(fake_worker):
    assert await health_status(fake_worker.target) == NOT_SERVING
    await fake_worker.stub.Init(worker_pb2.InitRequest(max_num_batched_tokens=64, max_num_seqs=8))
    assert await health_status(fake_worker.target) == SERVING


async def test_init_answers_the_cache_shape_and_a_new_epoch_each_time(fake_worker):
    first = await fake_worker.stub.Init(worker_pb2.InitRequest())
    second = await fake_worker.stub.Init(worker_pb2.InitRequest())
    assert (first.num_blocks, first.block_size, first.model_name) == (NUM_BLOCKS, 4, "fake")
    assert second.epoch > first.epoch


def new_request(rid: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(rid, prompt, len(prompt), blocks, 0, len(prompt), GREEDY)


async def run_plans(stub, plans: list[worker_pb2.StepPlan]) -> list[worker_pb2.StepResult]:
    call = stub.Steps()
    results = []
    for plan in plans:
        await call.write(plan)
        results.append(await call.read())
    await call.done_writing()
    return results


@pytest.fixture
async def resident_a(fake_worker):
    """Init, then step 1 makes request "a" (3 prompt tokens, block 5) resident. -> epoch."""
    epoch = (await fake_worker.stub.Init(worker_pb2.InitRequest())).epoch
    plan = StepPlan(1, new_requests=[new_request("a", [1, 2, 3], [5])])
    [result] = await run_plans(fake_worker.stub, [convert.plan_to_pb(plan, epoch)])
    assert not result.HasField("error") and list(result.request_ids) == ["a"]
    return epoch


def snapshot(fake_worker):
    return copy.deepcopy(fake_worker.runner.worker.resident)


@pytest.mark.parametrize("case, code, message", [
    ("stale_epoch", Code.STALE_EPOCH, "epoch"),
    ("step_gap", Code.STEP_GAP, "step 4 does not follow step 1"),
    ("unknown_request", Code.INVALID_PLAN, "'ghost'"),
    ("block_out_of_range", Code.INVALID_PLAN, f"block id {NUM_BLOCKS} out of range"),
])
async def test_bad_plans_are_rejected_without_touching_state(fake_worker, resident_a, case, code, message):
    epoch, step = resident_a, 2
    plan = StepPlan(step, new_requests=[new_request("b", [7, 8], [6])])
    if case == "stale_epoch":
        epoch += 1
    elif case == "step_gap":
        plan.step_id = 4
    elif case == "unknown_request":
        plan.finished_ids = ["ghost"]
    else:
        plan.table_updates = [TableUpdate("a", 1, [NUM_BLOCKS])]
    before = snapshot(fake_worker)
    good_next = convert.plan_to_pb(StepPlan(2, finished_ids=["a"]), resident_a)
    rejected, accepted = await run_plans(fake_worker.stub, [convert.plan_to_pb(plan, epoch), good_next])
    assert rejected.error.code == code and message in rejected.error.message
    assert rejected.step_id == plan.step_id and not rejected.request_ids
    # The rejected plan changed nothing: the same resident state, and step 2 still applies.
    assert not accepted.HasField("error")
    before.pop("a")
    assert snapshot(fake_worker) == before == {}


async def test_plans_before_init_are_rejected(fake_worker):
    [result] = await run_plans(fake_worker.stub, [convert.plan_to_pb(StepPlan(1), 0)])
    assert result.error.code == Code.STALE_EPOCH and "Init" in result.error.message


async def test_pipelined_plans_are_answered_in_order(fake_worker, resident_a):
    """Plan 3 is written before result 2 is read: both come back, in order."""
    call = fake_worker.stub.Steps()
    await call.write(convert.plan_to_pb(StepPlan(2), resident_a))
    await call.write(convert.plan_to_pb(StepPlan(3, table_updates=[TableUpdate("a", 1, [6])]), resident_a))
    first, second = await call.read(), await call.read()
    await call.done_writing()
    assert (first.step_id, second.step_id) == (2, 3)
    assert list(first.request_ids) == list(second.request_ids) == ["a"]
    assert fake_worker.runner.worker.resident["a"].num_computed == 5
