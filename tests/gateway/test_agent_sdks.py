"""Real agent libraries against the gateway with `pagoda serve`'s defaults (auto tool choice, the
parser picked from the chat template), over a real loopback port (live_gateway.py): the OpenAI
Agents SDK (a function tool round trip, run and streamed, on a Responses and a chat model),
LangChain's `bind_tools`, LiteLLM and `llm` with tool_choice auto, and the anthropic client's tools. Each
library is the dev extra's; a test skips where it is not installed."""

from __future__ import annotations

import json

import pytest

from tests.gateway.live_gateway import (
    AGENT_DEFAULTS,
    ANSWER,
    MODEL,
    TOOL_RESULT,
    RoundTripScripts,
    serve_http,
)

pytestmark = pytest.mark.timeout(120)
ASK = "What is the weather in Paris?"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture
async def base_url(make_gateway, upstream, tokenizer):
    upstream.engine.max_model_len = 8192
    upstream.engine.scripts = RoundTripScripts(upstream.engine, tokenizer)
    gateway = await make_gateway(**AGENT_DEFAULTS)
    async with serve_http(gateway.state) as url:
        yield url


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
async def test_openai_agents_sdk_tool_round_trip(base_url, api, streamed):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # no export to OpenAI's servers
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return TOOL_RESULT

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = (agents.OpenAIResponsesModel(MODEL, client) if api == "responses"
             else agents.OpenAIChatCompletionsModel(MODEL, client))
    agent = agents.Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model)
    if streamed:
        result = agents.Runner.run_streamed(agent, ASK)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    else:
        result = await agents.Runner.run(agent, ASK)
    assert calls == ["Paris"] and result.final_output == ANSWER


async def test_langchain_bind_tools_with_auto(base_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    bound = llm.bind_tools([WEATHER])  # tool_choice unset: auto
    message = await bound.ainvoke(ASK)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    chunks = [chunk async for chunk in bound.astream(ASK)]
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("get_weather", {"city": "Paris"})]


async def test_litellm_tools_with_auto(base_url):
    litellm = pytest.importorskip("litellm")
    reply = await litellm.acompletion(model=f"openai/{MODEL}", api_base=f"{base_url}/v1", api_key="unused",
                                      messages=[{"role": "user", "content": ASK}], tools=[WEATHER],
                                      tool_choice="auto")
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "tool_calls"


async def test_anthropic_client_tools_round_trip(base_url):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    ask = [{"role": "user", "content": ASK}]
    first = await client.messages.create(model=MODEL, max_tokens=4096, messages=ask, tools=tools)
    use = first.content[-1]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    second = await client.messages.create(model=MODEL, max_tokens=4096, tools=tools, messages=[
        *ask, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}]}])
    assert second.stop_reason == "end_turn" and second.content[0].text == ANSWER


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_llm_tool_chain_with_auto(base_url, tmp_path, monkeypatch, api):
    """Simon Willison's `llm`, an OpenAI-compatible model of its extra-openai-models.yaml: a tool
    chain (the call, the tool's result sent back, the answer)."""
    llm = pytest.importorskip("llm")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: pagoda\n  model_name: {MODEL}\n  api_base: {base_url}/v1\n  supports_tools: true\n"
        + ("  responses: true\n" if api == "responses" else ""))
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    calls = []

    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return TOOL_RESULT

    model = llm.get_async_model("pagoda")
    text = await model.chain(ASK, tools=[get_weather], key="unused").text()
    assert calls == ["Paris"] and text == ANSWER
