"""POST /v1/messages: an Anthropic Messages request becomes the chat request the OpenAI route
serves (`to_chat_request`), starts on the same path (`serving_chat.start_chat`: chat template, tool
plan and forced calls, tenancy, fallback, generate) and its result comes back as a message, whole or
as Anthropic's event stream (events.py).

Mappings: `system` is the first (system) message; a `tool_use` block is an assistant tool call and a
`tool_result` block a tool message; tool_choice auto / any / tool / none is "auto" / "required" /
a named function / "none". Finish reasons: "length" is max_tokens, a stop string stop_sequence,
a reply with calls tool_use, anything else end_turn. With --reasoning-parser the model's thinking
is a `thinking` block before the text (thinking blocks sent back are accepted and left out of the
prompt), `usage.output_tokens_details.thinking_tokens` counts it, and thinking.budget_tokens ends
it (thinking.py says exactly how). `output_config.format` (or the beta's `output_format`) is the
chat's response_format json_schema: the same llguidance grammar on the worker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.anthropic.events import message_events
from gateway.anthropic.protocol import (
    ImageBlock,
    InputMessage,
    MessagesRequest,
    MessagesResponse,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
    message_content,
    stop_reason,
)
from gateway.anthropic.thinking import thinking_tokens, within_budget
from gateway.generation import GenerationStep
from gateway.openai.chat_messages import ChatMessage, ImageUrl, ImageUrlPart, TextPart
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.serving_chat import reasoning_parsers, start_chat
from gateway.openai.streaming import until_disconnected
from gateway.openai.structured_outputs import JsonSchemaFormat, ResponseFormat
from gateway.openai.tool_parsers import ToolParser
from gateway.openai.tool_protocol import FunctionDef, NamedFunction, NamedToolChoice, ToolDef
from gateway.state import GatewayState
from gateway.upstream.fallback import prepend
from pagoda.contract.errors import InvalidRequestError
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _text(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)


def chat_messages(body: MessagesRequest) -> list[ChatMessage]:
    """The conversation as chat messages: system first, tool results as tool messages."""
    out = []
    if body.system:
        out.append(ChatMessage(role="system", content=body.system if isinstance(body.system, str)
                               else _text(body.system)))
    for i, message in enumerate(body.messages):
        out.extend(_chat_turn(message, i))
    return out


def _chat_turn(message: InputMessage, index: int = 0) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    if message.role == "system":  # text blocks only (protocol.py)
        return [ChatMessage(role="system", content=_text(message.content))]
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    results = [b for b in message.content if isinstance(b, ToolResultBlock)]
    if message.role == "user" and uses:
        raise InvalidRequestError("tool_use blocks can only be in assistant messages")
    if message.role == "assistant" and results:
        raise InvalidRequestError("tool_result blocks can only be in user messages")
    images = [(j, b) for j, b in enumerate(message.content) if isinstance(b, ImageBlock)]
    if images:  # text and images in their order; a turn with images carries no tool use (rare)
        if uses or results or message.role != "user":
            raise InvalidRequestError("image blocks are served in user messages without tool blocks")
        return [ChatMessage(role="user", content=[
            ImageUrlPart(image_url=ImageUrl(url=b.source.as_url()), where=f"messages[{index}].content[{j}]")
            if isinstance(b, ImageBlock) else TextPart(text=b.text)
            for j, b in enumerate(message.content) if isinstance(b, ImageBlock | TextBlock)])]
    turns = [ChatMessage(role="tool", tool_call_id=r.tool_use_id, content=r.text()) for r in results]
    if uses:
        calls = [{"id": u.id, "type": "function",
                  "function": {"name": u.name, "arguments": json.dumps(u.input, ensure_ascii=False)}} for u in uses]
        turns.append(ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls))
    elif texts or not results:
        turns.append(ChatMessage(role=message.role, content="".join(texts)))
    return turns


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that serves `body` (the fields Anthropic has, mapped one to one)."""
    tools = [ToolDef(function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema))
             for t in body.tools or ()] or None
    choice, parallel = body.tool_choice, None
    tool_choice = None  # tools without tool_choice: "auto", as Anthropic's default
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequestError('tool_choice of type "tool" needs the tool\'s name')
            tool_choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        else:
            tool_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        parallel = False if choice.disable_parallel_tool_use else None
    json_format = body.json_format
    response_format = (ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name="output", json_schema=json_format.json_schema)) if json_format is not None else None)
    return ChatCompletionRequest(
        model=body.model, messages=chat_messages(body), max_tokens=body.max_tokens,
        stop=body.stop_sequences or None, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel, stream=body.stream,
        response_format=response_format)


@dataclass(slots=True)
class _Reply:
    text: str = ""
    finish_reason: str | None = None
    stop: str | int | None = None
    usage: Usage | None = None
    token_ids: list[int] = field(default_factory=list)


async def _collect(steps: AsyncIterator[GenerationStep]) -> _Reply:
    reply = _Reply()
    async for step in steps:
        for chunk in step.chunks:
            reply.text += chunk.text
            reply.token_ids += chunk.token_ids
            if chunk.finish_reason is not None:
                reply.finish_reason, reply.stop = chunk.finish_reason, chunk.stop_reason
        if step.usage is not None:
            reply.usage = Usage(input_tokens=step.usage.prompt_tokens, output_tokens=step.usage.completion_tokens)
            return reply
    raise RuntimeError("generation ended without usage")  # generate() always ends with usage


async def create_message(body: MessagesRequest, http: Request, state: GatewayState) -> Response:
    if body.wants_thinking and state.config.reasoning_parser is None:
        raise InvalidRequestError("thinking needs a reasoning model: the gateway runs without --reasoning-parser")
    if body.wants_thinking and body.json_format is not None:
        # The grammar holds from the reply's first token: it leaves no room for a thinking span.
        raise InvalidRequestError("thinking cannot be combined with a JSON output format: the grammar "
                                  "constrains the whole reply, where the thinking would be")
    chat = to_chat_request(body)
    message_id = new_message_id()
    if ignored := body.ignored_fields(state.config.reasoning_parser):
        log.debug("request_fields_ignored", route="/v1/messages", request_id=message_id, fields=ignored)
    answer, plan = await start_chat(chat, http, state, message_id, clamp_max_tokens=True)
    model, (tokenizer, prompt_ids) = answer.pool.name, answer.context
    parsers: list[ToolParser] | None = plan.parsers(1, chat.parallel_tool_calls)
    parser = parsers[0] if parsers else None
    reasoners = reasoning_parsers(state.config, 1)
    reasoner = reasoners[0] if reasoners else None
    steps = prepend(answer.first, answer.steps)
    if reasoner is not None and body.thinking_budget is not None:
        steps = within_budget(steps, type(reasoner), body.thinking_budget)
    if body.stream:
        events = message_events(steps, message_id, model, len(prompt_ids), parser, reasoner,
                                lambda ids: thinking_tokens(reasoner, tokenizer, ids))
        return StreamingResponse(events, media_type="text/event-stream")
    reply = await until_disconnected(http, _collect(steps))
    reply.usage.output_tokens_details = thinking_tokens(reasoner, tokenizer, reply.token_ids)
    thinking, text, calls = None, reply.text, []
    if reasoner is not None:
        thinking, content = reasoner.extract_reasoning(text)
        text = content or ""
    if parser is not None:
        content, found = parser.extract_tool_calls(text)
        if found:
            text, calls = content or "", parser.kept(found)
    return JSONResponse(MessagesResponse(
        id=message_id, content=message_content(text, calls, thinking), model=model,
        stop_reason=stop_reason(reply.finish_reason, reply.stop, bool(calls) and reply.finish_reason == "stop"),
        stop_sequence=reply.stop if isinstance(reply.stop, str) else None, usage=reply.usage).model_dump())
