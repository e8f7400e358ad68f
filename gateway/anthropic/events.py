"""Anthropic's event stream for a streamed message: message_start, ping, then per content block
content_block_start / content_block_delta (text_delta, input_json_delta) / content_block_stop, then
message_delta (stop_reason, stop_sequence, usage) and message_stop. A failure after the headers is
an `error` event in Anthropic's error shape.

With --reasoning-parser the thinking streams first, as a thinking block (thinking_delta). Text
streams as it is generated (the tool parser holds back only what may be a call); tool_use
blocks follow the text block once the reply is complete, each one whole (its arguments as one
input_json_delta): Anthropic's blocks are sequential, and a call's arguments are final only then.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.anthropic.protocol import (
    MessagesResponse,
    OutputTokensDetails,
    Usage,
    stop_reason,
    tool_input,
    tool_use_id,
)
from gateway.errors import anthropic_error_body, to_client_error
from gateway.generation import GenerationStep
from gateway.openai.reasoning_parsers import ReasoningParser
from gateway.openai.streaming import sse_event
from gateway.openai.tool_parsers import ToolParser
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)


def event(payload: dict[str, Any]) -> str:
    """One SSE event named by its payload's type (`event: T` then `data: {...}`)."""
    return f"event: {payload['type']}\n{sse_event(payload)}"


class _Blocks:
    """The content blocks of the message being streamed: their indexes, and which one is open."""

    def __init__(self) -> None:
        self.count = 0
        self.text_open = False
        self.thinking_open = False

    def start(self, block: dict[str, Any]) -> str:
        self.count += 1
        return event({"type": "content_block_start", "index": self.count - 1, "content_block": block})

    def delta(self, delta: dict[str, Any]) -> str:
        return event({"type": "content_block_delta", "index": self.count - 1, "delta": delta})

    def stop(self) -> str:
        return event({"type": "content_block_stop", "index": self.count - 1})

    def thinking(self, text: str) -> list[str]:
        """Thinking text: into the thinking block, opened by the first (it comes before any other)."""
        out = [] if self.thinking_open else [self.start({"type": "thinking", "thinking": "", "signature": ""})]
        self.thinking_open = True
        return [*out, self.delta({"type": "thinking_delta", "thinking": text})]

    def end_thinking(self) -> list[str]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        return [self.stop()]

    def text(self, text: str) -> list[str]:
        out = [] if self.text_open else [*self.end_thinking(), self.start({"type": "text", "text": ""})]
        self.text_open = True
        return [*out, self.delta({"type": "text_delta", "text": text})]


PING_INTERVAL_S = 15.0  # a ping event while no token has come for this long


async def _next(steps: AsyncIterator[GenerationStep]) -> GenerationStep:
    return await anext(steps)


async def message_events(steps: AsyncIterator[GenerationStep], message_id: str, model: str, input_tokens: int,
                         parser: ToolParser | None, reasoner: ReasoningParser | None = None,
                         details: Callable[[list[int]], OutputTokensDetails | None] = lambda _ids: None,
                         ) -> AsyncIterator[str]:
    """The events of a message whose steps are `steps` (every one, the last with usage);
    `details` gives the usage's output_tokens_details from the reply's token ids."""
    blocks = _Blocks()
    calls: dict[int, dict[str, str]] = {}  # call index -> id, name, arguments (as they arrive)
    finish, stop, usage = None, None, None
    token_ids: list[int] = []
    try:
        start = MessagesResponse(id=message_id, content=[], model=model,
                                 usage=Usage(input_tokens=input_tokens, output_tokens=0))
        yield event({"type": "message_start", "message": start.model_dump()})
        yield event({"type": "ping"})
        first = asyncio.ensure_future(_next(steps))
        try:
            # A long prompt's prefill (Claude Code's 21k tokens: many minutes on a CPU) sends
            # nothing; Claude Code drops a stream silent for 300 s and retries it from scratch.
            # Anthropic's API pings while it waits; so does this.
            while not (await asyncio.wait((first,), timeout=PING_INTERVAL_S))[0]:
                yield event({"type": "ping"})
        finally:
            if not first.done():  # the client left while waiting: stop the upstream request
                first.cancel()
                await asyncio.wait((first,))
        step: GenerationStep | None = first.result()
        while step is not None:
            for chunk in step.chunks:
                token_ids += chunk.token_ids
                thinking, text = (reasoner.stream(chunk.text, chunk.finish_reason is not None)
                                  if reasoner is not None else ("", chunk.text))
                for line in blocks.thinking(thinking) if thinking else ():
                    yield line
                text, deltas, _ = (parser.extract_tool_calls_streaming(text, chunk.finish_reason)
                                   if parser is not None else (text, None, None))
                for line in blocks.text(text) if text else ():
                    yield line
                for delta in deltas or ():
                    call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = call["id"] or delta.id or ""
                    if delta.function is not None:
                        call["name"] = call["name"] or delta.function.name or ""
                        call["arguments"] += delta.function.arguments or ""
                if chunk.finish_reason is not None:
                    finish, stop = chunk.finish_reason, chunk.stop_reason
            usage = step.usage
            step = await anext(steps, None) if usage is None else None
        for line in blocks.end_thinking():
            yield line
        if not calls and not blocks.text_open and not blocks.count:  # an empty reply: one empty text block
            yield blocks.start({"type": "text", "text": ""})
            blocks.text_open = True
        if blocks.text_open:
            yield blocks.stop()
        for index in sorted(calls):
            call = calls[index]
            yield blocks.start({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["name"], "input": {}})
            yield blocks.delta({"type": "input_json_delta",
                                "partial_json": json.dumps(tool_input(call["arguments"]), ensure_ascii=False)})
            yield blocks.stop()
        reason = stop_reason(finish, stop, bool(calls) and finish == "stop")
        counts = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
        output_details = details(token_ids)
        if output_details is not None:
            counts["output_tokens_details"] = output_details.model_dump()
        yield event({"type": "message_delta",
                     "delta": {"stop_reason": reason, "stop_sequence": stop if isinstance(stop, str) else None},
                     "usage": counts})
        yield event({"type": "message_stop"})
    except Exception as error:  # noqa: BLE001 - headers are gone: report in-band
        client_error = to_client_error(error)
        log.warning("stream_failed", error=client_error.message, status=client_error.http_status)
        yield event(anthropic_error_body(client_error.http_status, client_error.message))
    finally:
        close = getattr(steps, "aclose", None)
        if close is not None:
            await close()
