"""Worker death with real processes: SIGKILL mid-generation.

- Restarted on the same port (as the launcher / compose restart it): the scheduler notices the
  broken Steps stream, preempts every resident request, purges the prefix index, re-Inits the new
  worker (new epoch) with backoff and recomputes. The streams finish with exactly the greedy tokens
  of an undisturbed run (tiny real model, fp32 CPU). A stale prefix index would point the recompute
  at KV blocks the new worker never wrote, so equality also proves the purge.
- Not back within --worker-timeout: the requests fail (UNAVAILABLE over gRPC, an error chunk then
  [DONE] mid-stream over HTTP, 503 for new requests and /ready) and nothing hangs; a worker that
  comes back later is served again.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.e2e.gateway_conftest import wait_for
from tests.reliability.conftest import completion, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]
PROMPTS = {"a": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
           "b": [300, 301, 302, 303, 304]}
MAX_TOKENS = 96


def generate(stub, request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    request = engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return stub.Generate(request, timeout=120)


def tokens_of(responses) -> list[int]:
    return [t for response in responses for seq in response.sequences for t in seq.token_ids]


def test_sigkilled_worker_restarted_on_the_same_port_gives_identical_greedy_output(
        tiny_model_dir, tmp_path):
    stack = start_stack(tmp_path, model=tiny_model_dir, gateway=False,
                        worker_flags={"device": "cpu", "dtype": "float32"},
                        scheduler_flags={"worker_timeout": 60, "max_num_batched_tokens": 256})
    try:
        with grpc.insecure_channel(stack.scheduler.target) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            undisturbed = {name: tokens_of(generate(stub, f"ref-{name}", p)) for name, p in PROMPTS.items()}
            calls = {name: generate(stub, f"hit-{name}", p) for name, p in PROMPTS.items()}
            firsts = {name: next(call) for name, call in calls.items()}  # both are running
            preemptions_before = stack.stats().num_preemptions
            stack.kill_worker()
            stack.restart_worker()
            rests = {name: list(call) for name, call in calls.items()}
        stats = stack.wait_idle()
        for name in PROMPTS:
            assert not firsts[name].finished and rests[name], "the kill must land mid-generation"
            assert tokens_of([firsts[name], *rests[name]]) == undisturbed[name]
            assert rests[name][-1].finished
        assert stats.num_preemptions >= preemptions_before + 1
        assert stats.idle and stats.num_used_blocks == 0 and stats.invariant_ok
        assert stats.worker_connected and stats.worker_resident_requests == 0
        log = stack.scheduler.log_tail(100_000)
        assert '"worker_lost"' in log and '"worker_reconnected"' in log
    finally:
        stack.stop()


def test_worker_not_back_in_time_fails_requests_then_recovers(tmp_path):
    stack = start_stack(tmp_path, scheduler_flags={"worker_timeout": 1.0})
    try:
        body = {"prompt": "The river", "max_tokens": 3000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "choices" in first
            stack.kill_worker()
            rest = [line for line in lines if line.startswith("data: ")]  # ends: nothing hangs
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == 503, error
        late = completion(stack.http_url)
        assert late.status_code == 503 and "Retry-After" in late.headers
        wait_for(lambda: httpx.get(f"{stack.http_url}/ready", timeout=5).status_code == 503)
        with grpc.insecure_channel(stack.scheduler.target) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(generate(engine_pb2_grpc.EngineStub(channel), "refused", [1, 2, 3], 4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        stats = stack.stats()
        assert stats.idle and stats.num_used_blocks == 0 and not stats.worker_connected

        stack.restart_worker()  # late, but the scheduler keeps trying: service resumes
        wait_for(lambda: httpx.get(f"{stack.http_url}/ready", timeout=5).status_code == 200, 30)
        assert completion(stack.http_url).status_code == 200
    finally:
        stack.stop()
