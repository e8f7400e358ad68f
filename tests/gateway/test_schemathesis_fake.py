"""Every error the gateway's HTTP API gives is in its API's shape (OpenAI's; Anthropic's under
/v1/messages), and none is a 5xx (issue 20, item 2).

schemathesis generates requests from the gateway's own OpenAPI schema (/openapi.json, FastAPI's)
for every operation, both schema-valid ("positive") and schema-violating ("negative") ones, and
sends them to the real app (the gateway's middlewares included, as `gateway/server.py` stacks
them) under uvicorn, in this process, over the fake Engine. Hand-written malformed bodies cover
what a schema-driven generator does not send: bytes that are not JSON, other content types, a JSON
array, huge numbers, nested nulls, lone surrogates, an empty body.

Every response is checked: status < 500, and for 4xx a body of exactly
`{"error": {"message", "type", "param", "code"}}` with `code` the status (under /v1/messages,
Anthropic's `{"type": "error", "error": {"type", "message"}}`). The figures (examples,
responses, bad ones) are printed with `-s`; docs/reliability.md records a run.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field

import grpc
import hypothesis
import pytest
import requests
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings

from gateway.config import GatewayConfig
from gateway.drain import InFlight, InFlightMiddleware
from gateway.openai.api_server import create_app
from gateway.state import GatewayState
from gateway.upstream.engine_client import EngineClient
from pagoda.runtime.grpc_health import HealthState
from pagoda.v1 import engine_pb2_grpc
from tests.e2e.conftest import free_port
from tests.gateway.conftest import SCRIPT_TEXTS
from tests.gateway.fake_engine import FakeEngine

EXAMPLES_PER_OPERATION = int(os.environ.get("PAGODA_SCHEMATHESIS_EXAMPLES", "150"))  # per operation and mode
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}

pytestmark = pytest.mark.timeout(240)


def _error_body(status: int, body: bytes) -> tuple[str | None, dict | None]:
    """(a problem, None) for a 5xx or a body that is not a JSON object; (None, None) below 400;
    else (None, the parsed body) for the API's own shape check."""
    if status >= 500:
        return f"server error {status}", None
    if status < 400:
        return None, None
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON", None
    if not isinstance(payload, dict):
        return f"{status} with a body that is not a JSON object", None
    return None, payload


def openai_error_problem(status: int, body: bytes) -> str | None:
    """What is wrong with a response, or None: no 5xx; a 4xx body in OpenAI's error shape."""
    problem, payload = _error_body(status, body)
    if payload is None:
        return problem
    error = payload.get("error")
    if set(payload) != {"error"} or not isinstance(error, dict):
        return f"{status} without the OpenAI error shape"
    if set(error) != OPENAI_ERROR_KEYS:
        return f"{status} error keys {sorted(error)}"
    if error["code"] != status or not isinstance(error["message"], str) or not error["message"]:
        return f"{status} with code {error['code']!r}, message {error['message']!r}"
    if not isinstance(error["type"], str) or not (error["param"] is None or isinstance(error["param"], str)):
        return f"{status} with type {error['type']!r}, param {error['param']!r}"
    return None


def anthropic_error_problem(status: int, body: bytes) -> str | None:
    """The same for Anthropic's Messages API (/v1/messages): {"type": "error", "error": {"type", "message"}}."""
    problem, payload = _error_body(status, body)
    if payload is None:
        return problem
    error = payload.get("error")
    if (set(payload) != {"type", "error"} or payload["type"] != "error"
            or not isinstance(error, dict) or set(error) != {"type", "message"}):
        return f"{status} without the Anthropic error shape"
    if not isinstance(error["type"], str) or not isinstance(error["message"], str) or not error["message"]:
        return f"{status} with type {error['type']!r}, message {error['message']!r}"
    return None


def error_problem(path: str, status: int, body: bytes) -> str | None:
    """Each API's errors in its own shape: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    return (anthropic_error_problem if anthropic else openai_error_problem)(status, body)


@dataclass
class Tally:
    examples: int = 0
    statuses: Counter = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)

    def record(self, path: str, what: str, status: int, body: bytes) -> None:
        self.examples += 1
        self.statuses[status] += 1
        if (problem := error_problem(path, status, body)) is not None:
            self.bad.append(f"{what}: {problem}: {body[:300]!r}")


class InProcessGateway:
    """A thread with its own event loop: the fake Engine (grpc.aio) and the gateway's app under
    uvicorn on a loopback port. Requests come from the test's thread, as from any client."""

    def __init__(self, tokenizer_dir: str, tokenizer) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._tokenizer_dir, self._tokenizer = tokenizer_dir, tokenizer
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="gateway")

    def __enter__(self) -> InProcessGateway:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *_exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        scripts = [self._tokenizer.encode(text, add_special_tokens=False) for text in SCRIPT_TEXTS]
        self.engine = FakeEngine(model_name=self._tokenizer_dir, scripts=scripts)
        self._engine_server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(self.engine, self._engine_server)
        health = HealthState("pagoda.v1.Engine")
        health.add_to_server(self._engine_server)
        engine_port = self._engine_server.add_insecure_port("127.0.0.1:0")
        await self._engine_server.start()
        await health.set_serving(True)
        config = GatewayConfig(scheduler=f"127.0.0.1:{engine_port}", max_request_bytes=64 * 1024)
        self._client = EngineClient(config.scheduler, timeout_s=5.0)
        state = GatewayState(config, self._client, tokenizer=self._tokenizer)
        await state.connect()
        app = InFlightMiddleware(create_app(state), InFlight())  # as gateway/server.py serves it
        self._http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="off",
                                                   log_level="warning", access_log=False))
        self._serving = asyncio.create_task(self._http.serve())
        while not self._http.started:
            assert not self._serving.done(), self._serving.exception()
            await asyncio.sleep(0.01)  # poll interval; bounded by __enter__'s 30 s

    async def _stop(self) -> None:
        self._http.should_exit = True
        await self._serving
        await self._client.close()
        await self._engine_server.stop(0)


@pytest.fixture(scope="module")
def served(tokenizer_dir, tokenizer):
    with InProcessGateway(tokenizer_dir, tokenizer) as gateway:
        yield gateway


def test_schemathesis_every_error_is_openai_shaped_and_none_is_5xx(served):
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
    session = requests.Session()
    tally, operations = Tally(), []
    for result in schema.get_all_operations():
        operation = result.ok()
        operations.append(operation.label)
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def send(case) -> None:
                response = case.call(base_url=served.url, session=session, timeout=20)
                tally.record(case.formatted_path, f"{case.method} {case.formatted_path} {case.body!r:.200}",
                             response.status_code, response.content)

            try:
                send()
            except hypothesis.errors.Unsatisfiable:  # e.g. no negative case for a body-less GET
                pass
    statuses = ", ".join(f"{status}: {count}" for status, count in sorted(tally.statuses.items()))
    print(f"\nschemathesis: {len(operations)} operations, {tally.examples} requests ({statuses}), "
          f"{len(tally.bad)} bad")
    assert len(operations) >= 9, operations
    assert tally.examples >= 300 and tally.statuses[400] > 0 and tally.statuses[200] > 0
    assert not tally.bad, "\n".join(tally.bad[:20])
    assert served.engine.active == set()  # every generated request ended upstream too


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON = {"content-type": "application/json"}
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MALFORMED = {
    "bytes, not JSON": (CHAT, b"\xff\xfe{not json", JSON),
    "truncated JSON": (CHAT, b'{"messages": [', JSON),
    "empty body": (CHAT, b"", JSON),
    "empty body, no content-type": (CHAT, b"", {}),
    "JSON array": (CHAT, b"[1, 2, 3]", JSON),
    "JSON string": (COMPLETIONS, b'"prompt"', JSON),
    "JSON null": (COMPLETIONS, b"null", JSON),
    "JSON number": (COMPLETIONS, b"12", JSON),
    "text/plain content-type": (CHAT, json.dumps(HI).encode(), {"content-type": "text/plain"}),
    "form content-type": (COMPLETIONS, b"prompt=hi&max_tokens=4",
                          {"content-type": "application/x-www-form-urlencoded"}),
    "multipart content-type": (COMPLETIONS, b"--x\r\n\r\nhi\r\n--x--",
                               {"content-type": "multipart/form-data; boundary=x"}),
    "no content-type": (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 4}', {}),
    "huge integer": (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", JSON),
    "huge float": (COMPLETIONS, b'{"prompt": "hi", "temperature": 1e400}', JSON),
    "negative huge float": (COMPLETIONS, b'{"prompt": "hi", "top_p": -1e308}', JSON),
    "NaN": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', JSON),
    "Infinity": (COMPLETIONS, b'{"prompt": "hi", "frequency_penalty": Infinity}', JSON),
    "seed past 64 bits": (COMPLETIONS, b'{"prompt": "hi", "seed": 99999999999999999999999}', JSON),
    "logit_bias huge key": (COMPLETIONS, b'{"prompt": "hi", "logit_bias": {"99999999999999999999": 1}}', JSON),
    "deep nesting": (COMPLETIONS, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON),
    "wrong types": (CHAT, b'{"messages": [{"role": 1, "content": {"a": 2}}], "n": "two"}', JSON),
    "messages null": (CHAT, b'{"messages": null}', JSON),
    "nested nulls": (CHAT, b'{"messages": [null, {"role": null, "content": null}]}', JSON),
    "content list of nulls": (CHAT, b'{"messages": [{"role": "user", "content": [null]}]}', JSON),
    "stop null item": (COMPLETIONS, b'{"prompt": "hi", "stop": [null]}', JSON),
    "prompt list of nulls": (COMPLETIONS, b'{"prompt": [null, null]}', JSON),
    "lone surrogate escape": (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', JSON),
    "lone low surrogate": (COMPLETIONS, b'{"prompt": "a\\udfffb", "max_tokens": 2}', JSON),
    "surrogate in stop": (COMPLETIONS, b'{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', JSON),
    "surrogate as key": (COMPLETIONS, b'{"prompt": "hi", "\\ud800": 1}', JSON),
    "surrogate in model": (COMPLETIONS, b'{"prompt": "hi", "model": "\\ud800", "max_tokens": 2}', JSON),
    "surrogate in cache_salt": (COMPLETIONS, b'{"prompt": "hi", "cache_salt": "\\udc00", "max_tokens": 2}', JSON),
    "surrogate in a streamed echo": (COMPLETIONS, b'{"prompt": "a\\ud800", "echo": true, "stream": true}', JSON),
    "surrogate in tokenize": ("/tokenize", b'{"prompt": "\\ud800"}', JSON),
    "surrogate pair reversed": (CHAT, b'{"messages": [{"role": "user", "content": "\\ude00\\ud83d"}]}', JSON),
    "invalid UTF-8 in a string": (COMPLETIONS, b'{"prompt": "\xc3\x28", "max_tokens": 2}', JSON),
    "tokenize not JSON": ("/tokenize", b"{", JSON),
    "tokenize array": ("/tokenize", b"[]", JSON),
    "detokenize huge ids": ("/detokenize", b'{"tokens": [1e30, -99999999999999999999]}', JSON),
    "detokenize nulls": ("/detokenize", b'{"tokens": [null]}', JSON),
    "over the body cap": (COMPLETIONS, b'{"prompt": "' + b"x" * 70_000 + b'"}', JSON),
}


# RFC 8259 lets a reader accept these (json.loads detects UTF-16 and skips a BOM): no 4xx required,
# but whatever the answer, no 5xx and no error in another shape.
LENIENT = {
    "UTF-16 body": (COMPLETIONS, '{"prompt": "hi", "max_tokens": 2}'.encode("utf-16"), JSON),
    "BOM then JSON": (COMPLETIONS, b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}', JSON),
}


@pytest.mark.parametrize("case", [*MALFORMED, *LENIENT])
def test_malformed_bodies_get_an_openai_shaped_4xx(served, case):
    path, body, headers = MALFORMED.get(case) or LENIENT[case]
    response = requests.post(f"{served.url}{path}", data=body, headers=headers, timeout=20)
    problem = openai_error_problem(response.status_code, response.content)
    assert problem is None, f"{problem}: {response.content[:500]!r}"
    if case in MALFORMED:
        assert 400 <= response.status_code < 500, response.text[:500]  # never a guess at what was meant


def test_a_lone_surrogate_is_a_400_naming_the_field_and_a_pair_is_text(served):
    body = b'{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}'
    refused = requests.post(f"{served.url}{CHAT}", data=body, headers=JSON, timeout=20)
    assert refused.status_code == 400 and "messages.0.content" in refused.json()["error"]["message"]
    pair = b'{"messages": [{"role": "user", "content": "x\\ud83d\\ude00"}], "max_tokens": 2}'
    assert requests.post(f"{served.url}{CHAT}", data=pair, headers=JSON, timeout=20).status_code == 200


@pytest.mark.parametrize("method, path", [
    ("GET", CHAT), ("PUT", COMPLETIONS), ("DELETE", "/v1/models"), ("PATCH", "/tokenize"),
    ("GET", "/v1/no-such-route"), ("POST", "/v1/models"), ("GET", "/v1/../../etc/passwd"),
    ("OPTIONS", CHAT), ("HEAD", CHAT), ("GET", "/v1/models?x=" + "a" * 8000),
])
def test_wrong_method_or_path_gets_an_openai_shaped_error(served, method, path):
    response = requests.request(method, f"{served.url}{path}", timeout=20)
    if method == "HEAD":  # no body by definition: the status alone
        assert response.status_code == 405
        return
    assert openai_error_problem(response.status_code, response.content) is None, response.content[:500]
