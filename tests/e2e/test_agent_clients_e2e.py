"""Issue 49 end to end: real agent libraries against real processes.

- `pagoda serve` with no flag but the model and ports (a fake worker: the protocol is under test)
  takes `tools` without `tool_choice` on every route, answers `HEAD /`, and logs a 4xx.
- On the real default model (SmolLM2-135M, the session's `smollm2_api` stack, whose chat template
  knows no tools: `auto` is hermes there), the OpenAI Agents SDK makes a function tool round trip
  on a Responses and a chat model. The SDK's `tool_choice="required"` forces the first call by
  grammar and then goes back to auto for the answer (what made it fail before auto was on), so the
  round trip does not depend on the small model choosing to call; LangChain and LiteLLM send
  tools with auto and get a well-formed reply."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.conftest import REPO, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def pagoda_serve(tiny_model_dir, tmp_path_factory):
    """`pagoda serve MODEL --fake` on free ports: the launcher's defaults otherwise."""
    ports = {flag: free_port() for flag in ("--gateway-port", "--grpc-port", "--worker-port", "--scheduler-port")}
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(tiny_model_dir), "--fake",
                             "--device", "cpu", *(str(p) for pair in ports.items() for p in pair)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 120
        while "Pagoda is serving" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < end, log_path.read_text()
            time.sleep(0.1)  # poll interval; the deadline bounds the wait
        yield f"http://127.0.0.1:{ports['--gateway-port']}", log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_pagoda_serve_defaults_take_tools_with_auto(pagoda_serve):
    url, log_path = pagoda_serve
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    ask = [{"role": "user", "content": ASK}]
    for path, body in (
            ("/v1/chat/completions", {"messages": ask, "tools": [WEATHER], "max_tokens": 4}),
            ("/v1/responses", {"input": ASK, "tools": [{"type": "function", **WEATHER["function"]},
                                                       {"type": "web_search"}], "max_output_tokens": 4}),
            ("/v1/messages", {"messages": ask, "max_tokens": 32000, "thinking": {"type": "adaptive"},
                              "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]})):
        reply = httpx.post(f"{url}{path}", json={"model": model, **body}, timeout=120)
        assert reply.status_code == 200, (path, reply.text)
    assert httpx.head(f"{url}/", timeout=10).status_code == 200
    bad = httpx.post(f"{url}/v1/responses", json={"input": "Hi", "include": ["nope"]}, timeout=10,
                     headers={"x-request-id": "e2e-agents-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "e2e-agents-1"
    end = time.monotonic() + 10
    while "e2e-agents-1" not in log_path.read_text():  # the gateway's line reaches the launcher's log
        assert time.monotonic() < end, log_path.read_text()[-3000:]
        time.sleep(0.05)
    line = next(json.loads(text) for text in log_path.read_text().splitlines() if "e2e-agents-1" in text)
    assert line["event"] == "client_error" and line["field"] == "include" and line["status"] == 400


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_tool_round_trip_on_smollm2(smollm2_api, api):
    agents = pytest.importorskip("agents")
    import asyncio

    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    async def run():
        client = AsyncOpenAI(base_url=f"{smollm2_api}/v1", api_key="unused", max_retries=0)
        model_id = (await client.models.list()).data[0].id
        model = (agents.OpenAIResponsesModel(model_id, client) if api == "responses"
                 else agents.OpenAIChatCompletionsModel(model_id, client))
        agent = agents.Agent(name="weather", instructions="Use the tools.", tools=[get_weather], model=model,
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                 max_tokens=48))
        return await agents.Runner.run(agent, ASK, max_turns=4)

    result = asyncio.run(run())
    assert calls and all(isinstance(city, str) and city for city in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_langchain_and_litellm_send_tools_with_auto_on_smollm2(smollm2_api):
    langchain_openai = pytest.importorskip("langchain_openai")
    litellm = pytest.importorskip("litellm")
    model_id = httpx.get(f"{smollm2_api}/v1/models", timeout=10).json()["data"][0]["id"]
    llm = langchain_openai.ChatOpenAI(model=model_id, base_url=f"{smollm2_api}/v1", api_key="unused",
                                      max_retries=0, temperature=0, max_tokens=48)
    message = llm.bind_tools([WEATHER]).invoke(ASK)
    assert isinstance(message.content, str) and all(c["name"] == "get_weather" for c in message.tool_calls)
    reply = litellm.completion(model=f"openai/{model_id}", api_base=f"{smollm2_api}/v1", api_key="unused",
                               messages=[{"role": "user", "content": ASK}], tools=[WEATHER], tool_choice="auto",
                               temperature=0, max_tokens=48)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
