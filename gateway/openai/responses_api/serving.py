"""POST /v1/responses: the request read as a chat completion (one choice) and started on the chat
path (`start_chat`: prompt, tools, structured outputs, admission, fallback), its reply written as a
Response object, whole or as the Responses API's events.

With --reasoning-parser, the model's thinking comes first as a `reasoning` item (its text as one
`reasoning_text` part, no summary; streamed as response.reasoning_text.delta events). A reply's
output is then a `message` item holding its text as one `output_text` part, then a
`function_call` item per call the tool parser finds (the chat's `tool_calls`). A reply cut by
`max_output_tokens` is `"incomplete"`, with `incomplete_details.reason` "max_output_tokens".
`usage.output_tokens_details.reasoning_tokens` counts the thinking's tokens, tags included
(`ReasoningParser.count_reasoning_tokens`); with --enable-request-timings the finished Response
carries the chat route's `timings` object (`timings_of`).

Streamed: response.created, response.in_progress; per message item output_item.added,
content_part.added, output_text.delta..., output_text.done, content_part.done, output_item.done;
per function call output_item.added, function_call_arguments.delta..., function_call_arguments.done,
output_item.done; response.completed (response.incomplete when cut short), which carries the
whole Response. Every event has a `sequence_number`, from 0.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.generation import GenerationStep, SequenceChunk, Usage
from gateway.openai.reasoning_parsers import ReasoningParser
from gateway.openai.responses import timings_of
from gateway.openai.responses_api.client_fields import ignored_fields
from gateway.openai.responses_api.protocol import ResponsesRequest
from gateway.openai.serving_chat import reasoning_parsers, start_chat
from gateway.openai.streaming import sse_stream, until_disconnected
from gateway.openai.tool_parsers import ToolParser
from gateway.openai.tool_protocol import DeltaToolCall, ToolCall
from gateway.state import GatewayState
from gateway.tokenizer import Tokenizer
from gateway.upstream.fallback import prepend
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
KEEPALIVE_S = 15.0  # response.in_progress again after this long with no event while tokens come
_now = time.monotonic  # (tests replace it, not the time module asyncio reads)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; `text` None: its part is not added yet (a stream's first event)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The model's thinking; `text` None: its part is not added yet (a stream's first event)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if text is None else [reasoning_part(text)]}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": status}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponseWriter:
    """One response's Response objects: whole (`whole`) or as events (`events`)."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, parser: ToolParser | None,
                 reasoner: ReasoningParser | None = None, tokenizer: Tokenizer | None = None,
                 with_timings: bool = False) -> None:
        self.body, self.id, self.model, self.parser, self.reasoner = body, response_id, model, parser, reasoner
        self.tokenizer, self.with_timings = tokenizer, with_timings
        self.created_at = int(time.time())

    def response(self, output: list[dict[str, Any]], status: str, last: GenerationStep | None = None,
                 token_ids: list[int] = ()) -> dict[str, Any]:
        """A Response object; `last`: the finished request's last step (usage, timings), with
        `token_ids` its reply's tokens (they count the reasoning)."""
        usage = last.usage if last is not None else None
        response = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                    "completed_at": int(time.time()) if status == "completed" else None,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                    "error": None, "model": self.model, "output": output,
                    "usage": usage_object(usage, self._reasoning_tokens(token_ids)) if usage is not None else None,
                    **self.body.echo()}
        timings = timings_of(last, self.with_timings) if last is not None else None
        if timings is not None:
            response["timings"] = timings.model_dump()
        return response

    def _reasoning_tokens(self, token_ids: list[int]) -> int:
        if self.reasoner is None or self.tokenizer is None or not token_ids:
            return 0
        return type(self.reasoner).count_reasoning_tokens(token_ids, self.tokenizer.decode)

    def whole(self, text: str, finish_reason: str | None, last: GenerationStep,
              token_ids: list[int] = ()) -> dict[str, Any]:
        """A finished reply: its thinking as a reasoning item, its text, and the calls in it as
        function_call items."""
        reasoning, text = self.reasoner.extract_reasoning(text) if self.reasoner is not None else (None, text)
        content, calls = (self.parser.extract_tool_calls(text or "") if self.parser is not None
                          else (text or "", []))
        calls = self.parser.kept(calls) if calls else []
        status = _status(finish_reason)
        output = [reasoning_item(new_id("rs"), reasoning, status)] if reasoning is not None else []
        if content is not None and (content.strip() or not (calls or output)):
            output.append(message_item(new_id("msg"), content, status))
        output += [function_call_item(new_id("fc"), call) for call in calls]
        return self.response(output, status, last, token_ids)

    async def events(self, first: GenerationStep, steps: AsyncIterator[GenerationStep]
                     ) -> AsyncIterator[dict[str, Any]]:
        stream = _EventStream()
        yield stream.event("response.created", response=self.response([], "in_progress"))
        yield stream.event("response.in_progress", response=self.response([], "in_progress"))
        step: GenerationStep | None = first
        last = first
        finish_reason: str | None = None
        token_ids: list[int] = []
        sent = _now()
        while step is not None:
            events: list[dict[str, Any]] = []
            for chunk in step.chunks:
                token_ids += chunk.token_ids
                reasoning, text = (self.reasoner.stream(chunk.text, chunk.finish_reason is not None)
                                   if self.reasoner is not None else ("", chunk.text))
                events += stream.reasoning(reasoning)
                if self.parser is not None:
                    text, calls, _ = self.parser.extract_tool_calls_streaming(text, chunk.finish_reason)
                else:
                    calls = None
                events += stream.text(text)
                events += stream.call_deltas(calls or ())
                finish_reason = chunk.finish_reason or finish_reason
            now = _now()
            if not events and now - sent >= KEEPALIVE_S:
                # The tool parser holds back what may be a call (hermes_scan.py): a slow model
                # (Qwen2.5-Coder-1.5B on a busy CPU, ~0.5 token/s) writing one sends nothing for
                # minutes, and Codex drops a stream with no event for 300 s and starts over. An
                # in_progress event (Codex ignores its content) says the response is alive.
                events.append(stream.event("response.in_progress", response=self.response([], "in_progress")))
            for event in events:
                yield event
            sent = now if events else sent
            last = step
            step = await anext(steps, None) if step.usage is None else None
        status = _status(finish_reason)
        for event in stream.finish(status):
            yield event
        yield stream.event(f"response.{status}", response=self.response(stream.output, status, last, token_ids))


class _EventStream:
    """The open items of a streamed response and the events that grow them."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # every item, in output order
        self.message: dict[str, Any] | None = None  # the message item text goes into now
        self.thinking: dict[str, Any] | None = None  # the open reasoning item (before any other)
        self.pending = ""  # blank text before any message item (it opens one only if nothing else comes)
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **copy.deepcopy(fields)}
        self.sequence_number += 1
        return event

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        """Thinking text: into the reasoning item, opened by the first (it comes before any other)."""
        if not text:
            return []
        events = []
        if self.thinking is None:
            self.thinking = reasoning_item(new_id("rs"), None, "in_progress")
            self.output.append(self.thinking)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=self.thinking))
            self.thinking["content"].append(reasoning_part(""))
            events.append(self.event("response.content_part.added", **self._where(self.thinking),
                                     content_index=0, part=self.thinking["content"][0]))
        self.thinking["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", **self._where(self.thinking),
                                 content_index=0, delta=text))
        return events

    def _close_reasoning(self, status: str) -> list[dict[str, Any]]:
        if self.thinking is None:
            return []
        item, self.thinking = self.thinking, None
        part = item["content"][0]
        item["status"] = status
        where = self._where(item)
        return [self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]),
                self.event("response.content_part.done", **where, content_index=0, part=part),
                self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.message is not None:
            return [self._delta(text)]
        if not (self.pending + text).strip():
            self.pending += text
            return []
        text, self.pending = self.pending + text, ""
        return [*self._close_reasoning("completed"), *self._open_message(), self._delta(text)]

    def _delta(self, text: str) -> dict[str, Any]:
        self.message["content"][0]["text"] += text
        return self.event("response.output_text.delta", **self._where(self.message), content_index=0,
                          delta=text, logprobs=[])

    def _open_message(self) -> list[dict[str, Any]]:
        self.message = message_item(new_id("msg"), None, "in_progress")
        self.output.append(self.message)
        events = [self.event("response.output_item.added", output_index=len(self.output) - 1, item=self.message)]
        self.message["content"].append(text_part(""))
        events.append(self.event("response.content_part.added", **self._where(self.message), content_index=0,
                                 part=self.message["content"][0]))
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self.message is None:
            return []
        message, self.message = self.message, None
        part = message["content"][0]
        message["status"] = status
        return [self.event("response.output_text.done", **self._where(message), content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **self._where(message), content_index=0, part=part),
                self.event("response.output_item.done", output_index=self.output.index(message), item=message)]

    def call_deltas(self, deltas: list[DeltaToolCall] | tuple[()]) -> list[dict[str, Any]]:
        events = []
        for delta in deltas:
            function = delta.function
            item = self.calls.get(delta.index)
            if item is None:  # a new call: the text before it is done
                events += self._close_reasoning("completed") + self._close_message("completed")
                call = ToolCall.of((function.name or "") if function else "", "")
                item = function_call_item(new_id("fc"), call, "in_progress")
                item["call_id"] = delta.id or call.id
                self.calls[delta.index] = item
                self.output.append(item)
                events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                         item=item))
            if function is not None and function.arguments:
                item["arguments"] += function.arguments
                events.append(self.event("response.function_call_arguments.delta", **self._where(item),
                                         delta=function.arguments))
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close every open item; a reply with nothing else still gets its (blank) message."""
        events = self._close_reasoning(status)
        if not self.output:
            events += self._open_message()
            if self.pending:
                events.append(self._delta(self.pending))
        events += self._close_message(status)
        for item in self.calls.values():
            item["status"] = "completed"
            events.append(self.event("response.function_call_arguments.done", **self._where(item),
                                     arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=self.output.index(item),
                                     item=item))
        return events


async def create_response(body: ResponsesRequest, http: Request, state: GatewayState) -> Response:
    chat = body.chat_request()
    response_id = new_id("resp")
    if ignored := ignored_fields(body):
        log.debug("request_fields_ignored", route="/v1/responses", request_id=response_id, fields=ignored)
    answer, plan = await start_chat(chat, http, state, response_id, clamp_max_tokens=True)
    parsers = plan.parsers(1, chat.parallel_tool_calls)
    reasoners = reasoning_parsers(state.config, 1)
    writer = ResponseWriter(body, response_id, answer.pool.name, parsers[0] if parsers else None,
                            reasoners[0] if reasoners else None, answer.context[0],
                            state.config.enable_request_timings)
    if body.stream:
        return StreamingResponse(sse_stream(writer.events(answer.first, answer.steps), named=True),
                                 media_type="text/event-stream")
    chunks, last = await until_disconnected(http, _collect(prepend(answer.first, answer.steps)))
    finish_reason = next((c.finish_reason for c in reversed(chunks) if c.finish_reason), None)
    return JSONResponse(writer.whole("".join(c.text for c in chunks), finish_reason, last,
                                     [t for c in chunks for t in c.token_ids]))


async def _collect(steps: AsyncIterator[GenerationStep]) -> tuple[list[SequenceChunk], GenerationStep]:
    """The one choice's chunks, and the last step (usage, timings)."""
    chunks = []
    async for step in steps:
        chunks += step.chunks
        if step.usage is not None:
            return chunks, step
    raise RuntimeError("generation ended without usage")  # generate() always ends with usage
