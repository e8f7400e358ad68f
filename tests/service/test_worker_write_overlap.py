"""The worker starts the next step once a result is handed to gRPC, not once gRPC reports it written:
at batch 1 that report is a round trip through gRPC's poller thread between two forwards. Writes
stay one at a time and in step order."""

from __future__ import annotations

import asyncio

from pagoda.contract import worker_codec as convert
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import NewRequestData, StepPlan
from pagoda.runtime.grpc_health import HealthState
from pagoda.v1 import worker_pb2
from worker_svc.fake.runner import FakeStepRunner
from worker_svc.service import WorkerServicer


class _SlowWriteContext:
    """A Steps call whose writes complete only when the test says so."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.written: list[int] = []
        self.writing = False

    async def write(self, result: worker_pb2.StepResult) -> None:
        assert not self.writing, "two writes in flight on one call"
        self.writing = True
        await self.release.wait()
        self.written.append(result.step_id)
        self.writing = False


class _CountingRunner(FakeStepRunner):
    def __init__(self) -> None:
        super().__init__(num_blocks=16, block_size=4, max_model_len=64)
        self.executed: list[int] = []
        self.second_step = asyncio.Event()

    def execute(self, plan):
        self.executed.append(plan.step_id)
        if plan.step_id == 2:
            self.second_step.set()
        return super().execute(plan)


async def test_the_next_step_runs_before_the_last_write_completes():
    runner = _CountingRunner()
    servicer = WorkerServicer(runner, HealthState("pagoda.v1.Worker"))
    epoch = (await servicer.Init(worker_pb2.InitRequest(), None)).epoch
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    plans = [convert.plan_to_pb(StepPlan(1, new_requests=[NewRequestData("a", [1, 2, 3], 3, [0], 0, 3, greedy)]),
                                epoch),
             convert.plan_to_pb(StepPlan(2), epoch)]
    both_sent = asyncio.Event()

    async def stream():
        for plan in plans:
            yield plan
        await both_sent.wait()  # the scheduler keeps the stream open

    context = _SlowWriteContext()
    steps = asyncio.create_task(servicer.Steps(stream(), context))
    await asyncio.wait_for(runner.second_step.wait(), timeout=10)  # never, if it waited for write 1
    assert runner.executed == [1, 2]
    assert context.written == [] and context.writing  # step 2 ran while step 1's write was pending
    context.release.set()
    both_sent.set()
    await asyncio.wait_for(steps, timeout=10)
    assert context.written == [1, 2]
