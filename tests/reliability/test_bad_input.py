"""Bad input never yields a 5xx: schemathesis over the gateway's OpenAPI schema, plus hand-written
cases that each expect one clear 4xx (HTTP) or INVALID_ARGUMENT (public gRPC and Engine API).

The stack is the session's shared fake stack (context 128, so generated requests stay cheap).
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import httpx
import pytest

from gateway.stop_strings import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import REPO
from tests.reliability.conftest import SHARED_MAX_MODEL_LEN as MAX_MODEL_LEN
from tests.reliability.conftest import SHARED_MAX_REQUEST_BYTES as MAX_REQUEST_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
SCHEMATHESIS_SECONDS = 30


@pytest.fixture
def stack(fake_stack):
    return fake_stack


def test_schemathesis_finds_no_server_error(stack, tmp_path):
    report = tmp_path / "schemathesis.json"
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{stack.http_url}/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "25", "--max-time", str(SCHEMATHESIS_SECONDS),
         "--seed", "1", "--request-timeout", "20", "--report-json-path", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=SCHEMATHESIS_SECONDS + 60)
    summary = json.loads(report.read_text())
    cases = summary["test_cases"]
    print(f"schemathesis: {cases['generated']} cases, {cases['with_failures']} failing, "
          f"operations tested {summary['operations']['tested']}")
    assert summary["failures"] == [] and summary["errors"] == [], result.stdout[-4000:]
    assert cases["generated"] > 100 and summary["operations"]["tested"] >= 5
    assert result.returncode == 0, result.stdout[-4000:]


GOOD = {"prompt": "The river", "max_tokens": 4}
HTTP_CASES = {
    "max_tokens huge": ({**GOOD, "max_tokens": 10**12}, 400),
    "max_tokens negative": ({**GOOD, "max_tokens": -1}, 400),
    "max_tokens not a number": ({**GOOD, "max_tokens": "many"}, 400),
    "temperature negative": ({**GOOD, "temperature": -0.5}, 400),
    "top_p above 1": ({**GOOD, "top_p": 1.5}, 400),
    "top_p zero": ({**GOOD, "top_p": 0}, 400),
    "empty prompt": ({**GOOD, "prompt": ""}, 400),
    "prompt over max_model_len": ({**GOOD, "prompt": list(range(1, MAX_MODEL_LEN + 10))}, 400),
    "n too large": ({**GOOD, "n": 10_000}, 400),
    "too many stop strings": ({**GOOD, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, 400),
    "stop string too long": ({**GOOD, "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, 400),
    "prompt of the wrong type": ({**GOOD, "prompt": {"text": "hi"}}, 400),
    "token id out of the vocabulary": ({**GOOD, "prompt": [1, 2, 10**9]}, 400),
    "unknown model": ({**GOOD, "model": "no-such-model"}, 404),
}


@pytest.mark.parametrize("case", HTTP_CASES)
def test_bad_completion_fields_get_a_clear_4xx(stack, case):
    body, status = HTTP_CASES[case]
    response = httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=10)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == status and response.json()["error"]["message"]


RAW_CASES = {
    "temperature NaN": b'{"prompt": "The river", "max_tokens": 4, "temperature": NaN}',
    "invalid UTF-8": b'{"prompt": "\xff\xfe bad", "max_tokens": 4}',
    "truncated JSON": b'{"prompt": "The river", "max_tokens": ',
}


@pytest.mark.parametrize("case", RAW_CASES)
def test_malformed_bodies_get_400(stack, case):
    response = httpx.post(f"{stack.http_url}/v1/completions", content=RAW_CASES[case],
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400, response.text


def test_chat_with_wrong_types_and_oversized_body(stack):
    chat = f"{stack.http_url}/v1/chat/completions"
    assert httpx.post(chat, json={"messages": "hi"}, timeout=10).status_code == 400
    assert httpx.post(chat, json={"messages": []}, timeout=10).status_code == 400
    big = {"messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]}
    assert httpx.post(chat, json=big, timeout=10).status_code == 413


GRPC_CASES = {
    "temperature negative": {"sampling": common_pb2.SamplingParams(temperature=-1)},
    "top_p above 1": {"sampling": common_pb2.SamplingParams(top_p=2)},
    "n too large": {"sampling": common_pb2.SamplingParams(n=10_000)},
    "max_tokens over the context": {"sampling": common_pb2.SamplingParams(max_tokens=MAX_MODEL_LEN * 4)},
    "empty prompt": {"prompt": ""},
    "too many stop strings": {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]},
}


@pytest.mark.parametrize("case", GRPC_CASES)
def test_public_grpc_bad_fields_are_invalid_argument(stack, case):
    request = gateway_pb2.GenerationRequest(**{"prompt": "The river", **GRPC_CASES[case]})
    with grpc.insecure_channel(stack.gateway.target) as channel:
        with pytest.raises(grpc.RpcError) as error:
            list(gateway_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()


ENGINE_CASES = {
    "empty prompt": ([], common_pb2.SamplingParams()),
    "temperature NaN": ([1, 2], common_pb2.SamplingParams(temperature=float("nan"))),
    "n too large": ([1, 2], common_pb2.SamplingParams(n=10_000)),
    "prompt over max_model_len": (list(range(1, MAX_MODEL_LEN + 10)), common_pb2.SamplingParams()),
    "token id out of the vocabulary": ([1, 10**9], common_pb2.SamplingParams(max_tokens=2)),
}


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_api_bad_fields_are_invalid_argument(stack, case):
    prompt, sampling = ENGINE_CASES[case]
    request = engine_pb2.GenerateRequest(request_id=f"bad-{case}", prompt_token_ids=prompt, sampling=sampling)
    with grpc.insecure_channel(stack.scheduler.target) as channel:
        with pytest.raises(grpc.RpcError) as error:
            list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()


def test_after_all_that_the_engine_is_clean(stack):
    stats = stack.stats()
    assert stats.idle and stats.invariant_ok and stats.num_used_blocks == 0
    assert httpx.post(f"{stack.http_url}/v1/completions", json=GOOD, timeout=10).status_code == 200
