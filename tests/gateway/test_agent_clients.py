"""What agent clients send, served (issue 49): requests shaped like Codex CLI's (/v1/responses) and
Claude Code's (/v1/messages) replayed against the gateway over the fake engine (many tools, their
extra fields, long system prompts), each extra field accepted as docs/gateway.md documents it,
max_tokens clamped to the context's room on those two routes only, `--tool-call-parser auto`,
the 4xx log line and `HEAD /`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.anthropic import serving_messages
from gateway.openai import middleware
from gateway.openai.responses_api import serving as responses_serving
from gateway.openai.responses_api.protocol import ResponsesRequest

REQUESTS = Path(__file__).parent / "agent_requests"
CODEX = json.loads((REQUESTS / "codex_cli_responses.json").read_text())  # its shape, every tool type
# What `codex exec "say hello"` (0.171.0) sent, captured (ids zeroed, the model renamed)
CODEX_CAPTURED = json.loads((REQUESTS / "codex_cli_0.171.0_responses.json").read_text())
CLAUDE_CODE = json.loads((REQUESTS / "claude_code_messages.json").read_text())
AGENT_DEFAULTS = {"enable_auto_tool_choice": True, "tool_call_parser": "auto"}  # pagoda serve's


class Recorder:
    """Stands in for a module's structlog logger: the (level, event, fields) of every line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))

    def events(self, name: str) -> list[dict]:
        return [fields for _, event, fields in self.lines if event == name]


@pytest.fixture
async def agent_gateway(make_gateway, upstream):
    upstream.engine.max_model_len = 8192  # an 8k-context model, as in the issue
    # the clients send the model id they were configured with: --served-model-name's
    return await make_gateway(**AGENT_DEFAULTS, served_model_name="pagoda-agent")


def _prompt(upstream, tokenizer) -> str:
    return tokenizer.decode(list(upstream.engine.requests[-1].prompt_token_ids), skip_special_tokens=False)


def _named_events(body: str) -> list[tuple[str, dict]]:
    out = []
    for block in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


async def test_a_codex_cli_request_streams_a_response(agent_gateway, upstream, tokenizer, monkeypatch):
    monkeypatch.setattr(responses_serving, "log", recorder := Recorder())
    reply = await agent_gateway.http.post("/v1/responses", json=CODEX)
    assert reply.status_code == 200, reply.text
    events = _named_events(reply.text)
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    text = "".join(data["delta"] for kind, data in events if kind == "response.output_text.delta")
    assert text == "Hello world. The end is near, friend."
    final = events[-1][1]["response"]
    assert [t["type"] for t in final["tools"]] == [t["type"] for t in CODEX["tools"]]  # echoed as sent
    assert final["reasoning"] == {"effort": "medium", "summary": "auto"}
    # function tools reach the model; built-in ones (custom apply_patch, web_search, ...) do not
    prompt = _prompt(upstream, tokenizer)
    assert all(f'"{name}"' in prompt for name in ("shell", "update_plan", "view_image"))
    assert "apply_patch" not in prompt and "mcp__docs" not in prompt and "web_search" not in prompt
    assert CODEX["instructions"][:200] in prompt and "say hello" in prompt
    ignored = recorder.events("request_fields_ignored")[0]["fields"]
    assert {"tools[type=custom]", "tools[type=web_search]", "tools[type=namespace]", "tools[type=local_shell]",
            "include=reasoning.encrypted_content", "reasoning.effort=medium", "reasoning.summary",
            "text.verbosity"} <= set(ignored)


async def test_a_captured_codex_cli_request_is_served(make_gateway, upstream, tokenizer):
    upstream.engine.max_model_len = 32768  # its prompt: 12.7k tokens in the tiny test tokenizer
    gateway = await make_gateway(**AGENT_DEFAULTS, served_model_name="pagoda-agent")
    reply = await gateway.http.post("/v1/responses", json=CODEX_CAPTURED)
    assert reply.status_code == 200, reply.text
    events = _named_events(reply.text)
    assert events[-1][0] == "response.completed"
    prompt = _prompt(upstream, tokenizer)
    offered = [t["name"] for t in CODEX_CAPTURED["tools"] if t["type"] == "function"]
    assert "exec_command" in offered and all(f'"{name}"' in prompt for name in offered)
    assert "multi_agent_v1" not in prompt  # a namespace of tools: not offered


async def test_a_claude_code_request_streams_a_message(agent_gateway, upstream, tokenizer, monkeypatch):
    monkeypatch.setattr(serving_messages, "log", recorder := Recorder())
    reply = await agent_gateway.http.post("/v1/messages", json=CLAUDE_CODE)
    assert reply.status_code == 200, reply.text
    events = [data for _, data in _named_events(reply.text)]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "Hello world. The end is near, friend."
    prompt = _prompt(upstream, tokenizer)
    # the system blocks first, the mid-conversation system message where it was sent
    assert prompt.index("You are Claude Code") < prompt.index("say hello") < prompt.index("plan mode")
    assert all(f'"{t["name"]}"' in prompt for t in CLAUDE_CODE["tools"])
    # max_tokens 32000 on an 8k model: clamped to the room the prompt leaves
    sent = upstream.engine.requests[-1]
    assert sent.sampling.max_tokens == 8192 - len(sent.prompt_token_ids)
    assert set(recorder.events("request_fields_ignored")[0]["fields"]) == {
        "context_management", "output_config.effort", "thinking.adaptive"}


async def test_a_clamped_reply_cut_by_the_context_says_so(make_gateway, upstream, tokenizer):
    """The clamp is reported as any length stop: stop_reason max_tokens / status incomplete, and
    usage counts the tokens served."""
    ask = [{"role": "user", "content": "say hello"}]
    prompt_tokens = len(tokenizer.encode_chat(ask, True))
    upstream.engine.max_model_len = prompt_tokens + 3  # read by the gateway when it connects
    gateway = await make_gateway(**AGENT_DEFAULTS)
    message = (await gateway.http.post("/v1/messages", json={"messages": ask, "max_tokens": 32000})).json()
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 3, message
    assert upstream.engine.requests[-1].sampling.max_tokens == 3  # the gateway's clamp
    response = (await gateway.http.post("/v1/responses", json={"input": ask, "max_output_tokens": 32000})).json()
    assert response["status"] == "incomplete" and response["usage"]["output_tokens"] == 3, response
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    # the chat route keeps vLLM's 400
    chat = await gateway.http.post("/v1/chat/completions", json={"messages": ask, "max_tokens": 32000})
    assert chat.status_code == 400 and "maximum context length" in chat.text


@pytest.mark.parametrize("extra", [
    {"client_metadata": {"originator": "codex_exec"}},
    {"prompt_cache_key": "k", "prompt_cache_retention": "24h", "safety_identifier": "u", "service_tier": "auto"},
    {"include": ["reasoning.encrypted_content", "web_search_call.action.sources"]},
    {"reasoning": {"summary": "auto"}},
    {"reasoning": {"effort": "high", "generate_summary": "concise"}},
    {"text": {"verbosity": "low"}},
    {"tools": [{"type": "web_search"}, {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
               {"type": "local_shell"}, {"type": "file_search", "vector_store_ids": ["v"]}]},
])
async def test_responses_accepts_what_agent_clients_send(agent_gateway, upstream, extra):
    reply = await agent_gateway.http.post("/v1/responses", json={"input": "Hi", **extra})
    assert reply.status_code == 200 and reply.json()["status"] == "completed", reply.text
    assert not upstream.engine.requests[-1].sampling.HasField("structured_outputs")


def test_reasoning_effort_none_turns_a_templates_thinking_off():
    for effort, kwargs in (("none", {"enable_thinking": False}), ("minimal", {"enable_thinking": False}),
                           ("low", None), (None, None)):
        body = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": effort}})
        assert body.chat_request().chat_template_kwargs == kwargs


@pytest.mark.parametrize("extra", [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]},
    {"thinking": {"type": "adaptive"}},
    {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
    {"output_config": {"effort": "max"}},
    {"metadata": {"user_id": "u", "session": "s"}},
    {"system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral", "ttl": "1h", "scope": "global"}}]},
    {"tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": True, "eager_input_streaming": True,
                "defer_loading": False}], "tool_choice": {"type": "none"}},
])
async def test_messages_accepts_what_agent_clients_send(agent_gateway, upstream, extra):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, **extra}
    reply = await agent_gateway.http.post("/v1/messages", json=body)
    assert reply.status_code == 200 and reply.json()["stop_reason"] in ("end_turn", "max_tokens"), reply.text


async def test_auto_picks_the_parser_from_the_template_and_tools_work_without_tool_choice(
        agent_gateway, upstream, tokenizer):
    """SmolLM2-like ChatML knows no tools: `auto` is hermes, the tools are listed as its text block,
    and a call in the reply comes back as a call on every route."""
    upstream.engine.scripts = [tokenizer.encode(
        '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>', add_special_tokens=False)]
    tool = {"type": "function", "function": {"name": "shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}}
    chat = (await agent_gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "list"}], "tools": [tool]})).json()
    assert chat["choices"][0]["finish_reason"] == "tool_calls", chat
    assert json.loads(chat["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"command": ["ls"]}
    assert "<tools>" in _prompt(upstream, tokenizer)
    response = (await agent_gateway.http.post("/v1/responses", json={
        "input": "list", "tools": [{"type": "function", **tool["function"]}, {"type": "web_search"}]})).json()
    assert [item["type"] for item in response["output"]] == ["function_call"], response
    message = (await agent_gateway.http.post("/v1/messages", json={
        "messages": [{"role": "user", "content": "list"}], "max_tokens": 64,
        "tools": [{"name": "shell", "input_schema": tool["function"]["parameters"]}]})).json()
    assert message["stop_reason"] == "tool_use" and message["content"][0]["input"] == {"command": ["ls"]}


async def test_every_4xx_is_logged_with_its_field_and_request_id(agent_gateway, monkeypatch):
    monkeypatch.setattr(middleware, "log", recorder := Recorder())
    reply = await agent_gateway.http.post("/v1/chat/completions", headers={"x-request-id": "abc123"}, json={
        "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {"name": "bad name!"}}]})
    assert reply.status_code == 400 and reply.headers["x-request-id"] == "abc123"
    line = recorder.events("client_error")[-1]
    assert line["route"] == "/v1/chat/completions" and line["status"] == 400 and line["request_id"] == "abc123"
    assert line["error_type"] == "BadRequestError" and line["field"] == "tools.0.function.name"
    reply = await agent_gateway.http.post("/v1/messages", json={"messages": []})  # Anthropic's shape
    line = recorder.events("client_error")[-1]
    assert reply.status_code == 400 and line["error_type"] == "invalid_request_error" and line["field"] == "messages"
    assert line["request_id"] == reply.headers["x-request-id"] and line["request_id"].startswith("req_")
    assert (await agent_gateway.http.get("/no/such/path")).status_code == 404
    assert recorder.events("client_error")[-1]["status"] == 404
    ok = await agent_gateway.http.get("/v1/models")
    assert ok.status_code == 200 and "x-request-id" not in ok.headers and len(recorder.events("client_error")) == 3


async def test_head_of_the_root_answers_200(agent_gateway):
    reply = await agent_gateway.http.head("/")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html") and not reply.content


async def test_count_tokens_counts_the_prompt_a_message_would_send(agent_gateway, upstream):
    body = {"model": "pagoda-agent", "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
    counted = await agent_gateway.http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    sent = await agent_gateway.http.post("/v1/messages", json={**body, "max_tokens": 4})
    assert sent.status_code == 200 and counted.json() == {"input_tokens": len(upstream.engine.requests[-1].prompt_token_ids)}
    assert (await agent_gateway.http.post("/v1/messages/count_tokens", json={"messages": []})).status_code == 400


class _AlternatingTemplate:
    """A tokenizer whose template refuses a system message after the first turn (Mistral's rule)."""

    class hf:  # noqa: N801 - stands in for the HF tokenizer's attribute
        chat_template = "roles must alternate"

    def __init__(self) -> None:
        self.rendered: list[list[dict]] = []

    def encode_chat(self, messages, add_generation_prompt, **kwargs):
        if any(i and m["role"] == "system" for i, m in enumerate(messages)):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        self.rendered.append(messages)
        return [1] * len(messages)


def test_a_late_system_message_joins_the_next_user_turn_where_the_template_refuses_it():
    from gateway.openai.protocol import ChatCompletionRequest
    from gateway.openai.serving_chat import ToolPlan, chat_prompt_ids, fold_late_system_messages
    from gateway.openai.tool_parsers import HermesToolParser

    tokenizer = _AlternatingTemplate()
    body = ChatCompletionRequest(messages=[
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "system", "content": "Plan mode."}, {"role": "user", "content": "Go"}])
    assert chat_prompt_ids(body, tokenizer, ToolPlan(HermesToolParser)) == [1, 1, 1, 1]
    assert tokenizer.rendered[-1][-1] == {"role": "user", "content": "Plan mode.\n\nGo"}
    # none after it: the last user turn takes it; nothing to fold: None (the template's error stands)
    assert fold_late_system_messages([{"role": "user", "content": "Hi"}, {"role": "system", "content": "S"}]) == [
        {"role": "user", "content": "Hi\n\nS"}]
    assert fold_late_system_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]) is None
