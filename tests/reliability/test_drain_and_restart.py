"""Scheduler down and graceful drain, with real processes (fake worker).

- Scheduler killed: the gateway answers 503 (+ Retry-After) and /ready 503, its public gRPC
  UNAVAILABLE; a scheduler restarted on the same port brings it back without touching the gateway.
- SIGTERM on the gateway or the scheduler: not ready at once (/ready 503, gRPC health
  NOT_SERVING), new requests 503 / UNAVAILABLE, the request in flight finishes with every token,
  then the process exits 0 well within --shutdown-timeout.
"""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2

from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import health_status
from tests.e2e.gateway_conftest import wait_for
from tests.reliability.conftest import completion, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
LONG = 1500  # tokens: the fake worker takes a few seconds, long enough to observe the drain
SHUTDOWN_TIMEOUT_S = 30


def _ready(http_url: str) -> int:
    return httpx.get(f"{http_url}/ready", timeout=5).status_code


def _public_generate(target: str) -> list[gateway_pb2.GenerationChunk]:
    with grpc.insecure_channel(target) as channel:
        request = gateway_pb2.GenerationRequest(prompt="The river",
                                                sampling=common_pb2.SamplingParams(max_tokens=4))
        return list(gateway_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10))


def test_gateway_answers_503_while_the_scheduler_is_down_then_recovers(tmp_path):
    stack = start_stack(tmp_path)
    try:
        assert completion(stack.http_url).status_code == 200
        os.kill(stack.scheduler.proc.pid, signal.SIGKILL)
        stack.scheduler.proc.wait(10)
        down = completion(stack.http_url)
        assert down.status_code == 503 and "Retry-After" in down.headers
        assert down.json()["error"]["code"] == 503
        assert _ready(stack.http_url) == 503
        with pytest.raises(grpc.RpcError) as refused:
            _public_generate(stack.gateway.target)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert httpx.get(f"{stack.http_url}/health", timeout=5).status_code == 200  # alive

        stack.restart_scheduler()
        wait_for(lambda: _ready(stack.http_url) == 200, 30)
        assert completion(stack.http_url).status_code == 200
        assert len(_public_generate(stack.gateway.target)) >= 1
    finally:
        stack.stop()


def test_gateway_sigterm_drains_in_flight_requests_and_exits_0(tmp_path):
    stack = start_stack(tmp_path, gateway_args=("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)))
    try:
        body = {"prompt": "The river", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            sent_at = time.monotonic()
            stack.gateway.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: health_status(stack.gateway.target) == health_pb2.HealthCheckResponse.NOT_SERVING)
            assert _ready(stack.http_url) == 503
            assert completion(stack.http_url).status_code == 503
            with pytest.raises(grpc.RpcError) as refused:
                _public_generate(stack.gateway.target)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert stack.gateway.proc.wait(SHUTDOWN_TIMEOUT_S) == 0
        drain_seconds = time.monotonic() - sent_at
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == LONG
        log = stack.gateway.log_tail(100_000)
        assert '"in_flight": 1' in log and '"drained": true' in log
        print(f"gateway drain: {drain_seconds:.2f}s for a {LONG}-token stream")
        assert drain_seconds < SHUTDOWN_TIMEOUT_S
    finally:
        stack.stop()


def test_scheduler_sigterm_drains_running_requests_and_exits_0(tmp_path):
    stack = start_stack(tmp_path, gateway=False, scheduler_flags={"shutdown_timeout": SHUTDOWN_TIMEOUT_S})
    try:
        with grpc.insecure_channel(stack.scheduler.target) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            request = engine_pb2.GenerateRequest(
                request_id="in-flight", prompt_token_ids=[1, 2, 3],
                sampling=common_pb2.SamplingParams(max_tokens=LONG, ignore_eos=True))
            call = stub.Generate(request, timeout=60)
            first = next(call)
            sent_at = time.monotonic()
            stack.scheduler.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: health_status(stack.scheduler.target) == health_pb2.HealthCheckResponse.NOT_SERVING)
            late = engine_pb2.GenerateRequest(request_id="late", prompt_token_ids=[1],
                                               sampling=common_pb2.SamplingParams(max_tokens=2))
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(late, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(call)
        assert stack.scheduler.proc.wait(SHUTDOWN_TIMEOUT_S) == 0
        drain_seconds = time.monotonic() - sent_at
        tokens = [t for r in [first, *rest] for s in r.sequences for t in s.token_ids]
        assert len(tokens) == LONG and rest[-1].finished
        print(f"scheduler drain: {drain_seconds:.2f}s for a {LONG}-token request")
    finally:
        stack.stop()
