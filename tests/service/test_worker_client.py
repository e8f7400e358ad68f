"""StepStream turns every way a Steps call can end into WorkerLostError, so the engine resyncs."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.contract.step import StepPlan
from scheduler_svc.worker_client import StepStream, WorkerLostError


class FinishedCall:
    """A Steps call whose worker end already closed: grpc.aio's write raises InvalidStateError."""

    async def write(self, message) -> None:
        raise asyncio.InvalidStateError("RPC already finished.")


async def test_a_write_racing_the_end_of_the_stream_is_a_lost_worker():
    stream = StepStream(FinishedCall(), epoch=7)
    with pytest.raises(WorkerLostError, match="sending step 3 failed"):
        await stream.send(StepPlan(step_id=3))
