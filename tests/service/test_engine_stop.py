"""Stopping the scheduler with requests still running: they end with UNAVAILABLE "shutting down"
(retryable, and what the drain promised), never as calls the server cancels."""

from __future__ import annotations

import grpc
import pytest

from tests.service.test_engine_service import first_response, generate_request, read_rest


async def test_requests_running_at_stop_end_unavailable(engine_factory):
    running, stub = await engine_factory()
    call = stub.Generate(generate_request("long", [1, 2, 3], max_tokens=200))
    await first_response(call)  # it is running
    await running.stop(5.0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await read_rest(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert "scheduler stopped before this request finished" in info.value.details()
