"""The gateway on a real loopback HTTP port (uvicorn, in the test's event loop) over the scripted
fake engine: what clients that open their own connections (the Agents SDK, LangChain, LiteLLM, the
Codex and Claude Code CLIs) are tested against. The fake engine replies with a tool call until the
prompt holds a tool result, then with a plain answer: one tool round trip, deterministic."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn

from gateway.openai.api_server import create_app
from gateway.state import GatewayState
from gateway.tokenizer import Tokenizer
from tests.gateway.fake_engine import FakeEngine

MODEL = "pagoda-agent"  # --served-model-name: the id the clients are configured with
AGENT_DEFAULTS = {"enable_auto_tool_choice": True, "tool_call_parser": "auto", "served_model_name": MODEL}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."
TOOL_RESULT = "sunny, 21 C"


class RoundTripScripts(list):
    """The engine's scripts, chosen per request: the call until the latest prompt holds a tool
    result (Hermes' `<tool_response>` or the result's text), then the answer; `calls=False`: the
    answer always. FakeEngine reads `scripts[i]` after recording the request."""

    def __init__(self, engine: FakeEngine, tokenizer: Tokenizer, calls: bool = True, call: str = CALL) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.call = tokenizer.encode(call, add_special_tokens=False)
        self.answer = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.calls = calls
        super().__init__([self.answer])

    def __getitem__(self, index):
        prompt = self.tokenizer.decode(list(self.engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
        answered = "<tool_response>" in prompt or TOOL_RESULT in prompt
        return self.call if self.calls and not answered else self.answer


@contextlib.asynccontextmanager
async def serve_http(state: GatewayState, deadline_s: float = 20.0) -> AsyncIterator[str]:
    """The gateway's app on 127.0.0.1:<free port>; yields its base URL (no /v1)."""
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while not server.started:  # uvicorn has no "started" event to await: poll, bounded
            assert not task.done() and loop.time() < end, "uvicorn did not start"
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
