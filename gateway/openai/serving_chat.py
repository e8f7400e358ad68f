"""POST /v1/chat/completions: messages rendered with the model's chat template, replies out.

Tools take one path: `tool_plan` reads the request's tools and tool_choice once; the plan's
`ToolParser` (the model's format, `--tool-call-parser`) renders them into the prompt, gives the
grammar of a forced call, and takes the calls out of each choice, whole or streamed (one parser
per choice).

With --reasoning-parser, a `ReasoningParser` per choice first splits the model's thinking out of
its text into `reasoning_content`; the tool parser reads only what is left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.config import GatewayConfig
from gateway.generation import (
    GenerationStep,
    SequenceChunk,
    check_structured_outputs,
    generate,
    start_request_span,
)
from gateway.multimodal import load_images
from gateway.openai.middleware import admit
from gateway.openai.prompt_logprobs import vllm_prompt_logprobs
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.reasoning_parsers import ReasoningParser, ReasoningParserManager
from gateway.openai.request_inputs import build_generation_input, build_sampling, new_request_id
from gateway.openai.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    timings_of,
    usage_info,
)
from gateway.openai.streaming import sse_stream, until_disconnected
from gateway.openai.tool_parsers import AUTO, ToolParser, ToolParserManager, selected_tool_parser
from gateway.openai.tool_protocol import NamedToolChoice, ToolDef
from gateway.state import GatewayState
from gateway.tokenizer import Tokenizer
from gateway.upstream.fallback import AdmitOnce, Answer, first_answer, prepend
from gateway.upstream.model_pools import ModelPool
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.image_inputs import ImageError
from pagoda.contract.params import SamplingParams
from pagoda.contract.structured import StructuredOutputsParams
from pagoda.runtime.logging import get_logger
from pagoda.runtime.telemetry import context_from_headers

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools mean for it: the model's tool-call format, the tools it may call
    (None: it calls none, so none are in its prompt and its replies stay text) and the grammar that
    forces a call (None: the model chooses)."""

    parser: type[ToolParser]
    tools: list[ToolDef] | None = None
    forced: StructuredOutputsParams | None = None

    def parsers(self, n: int, parallel_tool_calls: bool | None) -> list[ToolParser] | None:
        """One parser per choice (None: no calls to look for)."""
        if self.tools is None:
            return None
        names = [t.function.name for t in self.tools]
        return [self.parser(parallel_tool_calls, names) for _ in range(n)]


def tool_parser_class(config: GatewayConfig, tokenizer: Tokenizer | None) -> type[ToolParser]:
    """The --tool-call-parser's class; with `auto`, the one `tokenizer`'s chat template names
    (tool_parsers/auto_select.py; no tokenizer yet: hermes)."""
    name = config.tool_call_parser
    if name == AUTO:
        name = selected_tool_parser(getattr(tokenizer.hf, "chat_template", None) if tokenizer is not None else None)
    return ToolParserManager.get_tool_parser(name)


def tool_plan(body: ChatCompletionRequest, config: GatewayConfig, tokenizer: Tokenizer | None = None) -> ToolPlan:
    """tool_choice "none" calls nothing; "auto" lets the model choose (needs
    --enable-auto-tool-choice, as vLLM); "required" and a named function force a call in the
    parser's format with a grammar whose arguments follow the function's JSON schema. `tokenizer`:
    the model's, whose chat template picks the format under `--tool-call-parser auto`."""
    parser = tool_parser_class(config, tokenizer)
    tools, tool_choice = body.tools, body.tool_choice
    if not tools or tool_choice == "none":
        return ToolPlan(parser)
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == tool_choice.function.name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names {tool_choice.function.name!r}, which is not in tools")
        return ToolPlan(parser, tools, parser.forced_call_grammar(chosen))
    if tool_choice == "required":
        return ToolPlan(parser, tools, parser.forced_call_grammar(tools))
    if not config.enable_auto_tool_choice:  # "auto", or tools without tool_choice (OpenAI's default is auto)
        raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                  "--tool-call-parser to be set (or use tool_choice \"required\" "
                                  "or a named function)")
    return ToolPlan(parser, tools)


def reasoning_parsers(config: GatewayConfig, n: int) -> list[ReasoningParser] | None:
    """One reasoning parser per choice (None: --reasoning-parser is not set)."""
    if config.reasoning_parser is None:
        return None
    parser = ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)
    return [parser() for _ in range(n)]


def with_forced_call(sampling: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """The sampling params with the grammar of a required / named call, if the plan forces one."""
    if plan.forced is None:
        return sampling
    if sampling.structured_outputs is not None:
        raise InvalidRequestError("a required or named tool_choice cannot be combined with "
                                  "response_format or structured outputs")
    return dataclasses.replace(sampling, structured_outputs=plan.forced)


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Tokenizer, plan: ToolPlan) -> list[int]:
    """The prompt: the messages, with the plan's tools listed only when the model may call them.
    A template that refuses a system message after the first turn (Mistral's, Gemma's: roles must
    alternate) gets each such message's text at the start of the next user turn instead (OpenAI's and
    Anthropic's APIs take system messages anywhere: Claude Code sends them mid-conversation)."""
    messages, tool_kwargs = plan.parser.render_prompt([m.as_template_dict() for m in body.messages], plan.tools,
                                                      getattr(tokenizer.hf, "chat_template", None))
    kwargs = {**tool_kwargs, **(body.chat_template_kwargs or {})}
    try:
        return tokenizer.encode_chat(messages, body.add_generation_prompt, **kwargs)
    except Exception as error:  # noqa: BLE001 - ValueError (no template, refused), jinja's TemplateError
        folded = fold_late_system_messages(messages)
        if folded is not None:
            try:
                ids = tokenizer.encode_chat(folded, body.add_generation_prompt, **kwargs)
                log.debug("late_system_messages_folded", error=str(error))
                return ids
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                pass
        if isinstance(error, ValueError):
            raise InvalidRequestError(str(error)) from None
        raise InvalidRequestError(f"the chat template failed: {error}") from None


def fold_late_system_messages(messages: list[dict]) -> list[dict] | None:
    """Each system message after the first turn moved into the next user message's text (the last
    user message when none follows); None when there is none to move."""
    late = [i for i, m in enumerate(messages) if i > 0 and m.get("role") == "system"]
    if not late:
        return None
    out, pending = [], []
    for i, message in enumerate(messages):
        if i in late:
            pending.append(str(message.get("content") or ""))
        elif pending and message.get("role") == "user" and isinstance(message.get("content"), str):
            out.append({**message, "content": "\n\n".join([*pending, message["content"]])})
            pending = []
        else:
            out.append(message)
    if pending:  # no user turn after them: the last user turn takes them
        last = next((j for j in range(len(out) - 1, -1, -1) if out[j].get("role") == "user"
                     and isinstance(out[j].get("content"), str)), None)
        if last is None:
            return None
        out[last] = {**out[last], "content": "\n\n".join([out[last]["content"], *pending])}
    return out


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(tokenizer: Tokenizer, chunk: SequenceChunk) -> ChatLogprobs:
    content = []
    for token_id, logprob in zip(chunk.token_ids, chunk.logprobs, strict=False):
        chosen = _top(tokenizer, token_id, logprob.logprob)
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[
            _top(tokenizer, t.token_id, t.logprob) for t in logprob.top]))
    return ChatLogprobs(content=content)


def clamped(sampling: SamplingParams, prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """max_tokens cut to the room the prompt leaves in the context (agent clients send 32000 by habit
    to an 8k model); a prompt that leaves no room keeps its max_tokens and gets the usual 400."""
    room = max_model_len - prompt_tokens
    if sampling.max_tokens is None or not 0 < room < sampling.max_tokens:
        return sampling
    log.debug("max_tokens_clamped", requested=sampling.max_tokens, served=room, prompt_tokens=prompt_tokens)
    return dataclasses.replace(sampling, max_tokens=room)


async def start_chat(body: ChatCompletionRequest, http: Request, state: GatewayState,
                     request_id: str, clamp_max_tokens: bool = False) -> tuple[Answer, ToolPlan]:
    """Start `body` on the first pool of its model's route that answers (the fallback model when
    the first refuses), and the request's tool plan. The answer's context is (tokenizer, prompt ids).
    Every chat-shaped API starts here: /v1/chat/completions, /v1/responses and Anthropic's
    /v1/messages; the last two clamp max_tokens to the context's room (`clamped`), the chat route
    keeps vLLM's 400."""
    route = state.route(body.model)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # The requested model's template picks the format under --tool-call-parser auto (a fallback
    # model answers in the same format: the plan, and a forced call's grammar, are made once).
    plan = tool_plan(body, state.config, next((p.tokenizer for p in route.pools if p.tokenizer is not None), None))
    admit_once = AdmitOnce(lambda r, max_model_len: admit(http, r, max_model_len))
    images = await load_images(body.messages, state.config.media)  # a bad one: its 400, before any pool

    async def start(pool: ModelPool, _attempt: int):  # the request prepared for `pool`'s model
        tokenizer, info = pool.require_ready()
        sampling = build_sampling(body, body.effective_max_tokens, logprobs, tokenizer, info.vocab_size,
                                  body.prompt_logprobs)
        sampling = with_forced_call(sampling, plan)
        await check_structured_outputs(sampling)
        if images and tokenizer.images is None:  # before its template meets image parts
            raise InvalidRequestError(f"model {pool.name!r} does not take images (not a vision-language model)")
        prompt_ids = chat_prompt_ids(body, tokenizer, plan)
        prompt_ids, mm_inputs = await with_images(tokenizer, prompt_ids, images)
        if clamp_max_tokens:
            sampling = clamped(sampling, len(prompt_ids), info.max_model_len)
        request = build_generation_input(body, request_id, prompt_ids, sampling, info.max_model_len, mm_inputs)
        request, lease = admit_once(request, info.max_model_len)
        span = start_request_span("chat", pool.name, context_from_headers(http.headers), request,
                                  lease.tenant.name, route.fallback_from(pool))
        return (generate(pool.client, tokenizer, request, span, lease, model=pool.name),
                (tokenizer, request.prompt_token_ids))

    # Upstream errors before the first step keep their HTTP status (and may move to the fallback).
    return await first_answer(route, start, lambda first: until_disconnected(http, first)), plan


async def with_images(tokenizer: Tokenizer, prompt_ids: list[int], images: list) -> tuple[list[int], tuple]:
    """The prompt with each image placeholder expanded to its image's tokens, and the images'
    pixels (the model's own processor, off the event loop); unchanged without images."""
    if not images:
        return prompt_ids, ()
    try:
        return await asyncio.to_thread(tokenizer.images.expand, prompt_ids, images)
    except ImageError as error:
        raise InvalidRequestError(str(error)) from None


async def create_chat_completion(body: ChatCompletionRequest, http: Request,
                                 state: GatewayState) -> Response:
    request_id = new_request_id("chatcmpl")
    answer, plan = await start_chat(body, http, state, request_id)
    model, (tokenizer, prompt_ids) = answer.pool.name, answer.context
    names = tokenizer.logprob_names(body.return_tokens_as_token_ids)  # names the logprobs' tokens
    if not body.stream:
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=""),
                              logprobs=ChatLogprobs(content=[]) if body.logprobs else None)
                   for i in range(body.n)]
        steps = prepend(answer.first, answer.steps)
        prompt_logprobs: list = []
        last = await until_disconnected(http, _collect(steps, choices, names, prompt_logprobs))
        tools = plan.parsers(body.n, body.parallel_tool_calls) or [None] * body.n
        reasoners = reasoning_parsers(state.config, body.n) or [None] * body.n
        for choice, parser, reasoner in zip(choices, tools, reasoners, strict=True):
            _finish_choice(choice, parser, reasoner)
        return JSONResponse(ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage_info(last.usage),
            timings=timings_of(last, state.config.enable_request_timings),
            prompt_logprobs=(vllm_prompt_logprobs(tokenizer, prompt_ids, prompt_logprobs)
                             if body.prompt_logprobs is not None else None)).model_dump())
    events = _stream(answer.first, answer.steps, body, names, request_id, model,
                     plan.parsers(body.n, body.parallel_tool_calls), reasoning_parsers(state.config, body.n),
                     state.config.enable_request_timings)
    return StreamingResponse(sse_stream(events), media_type="text/event-stream")


async def _collect(steps: AsyncIterator[GenerationStep], choices: list[ChatChoice], names: Tokenizer,
                   prompt_logprobs: list):
    """Fold the steps into `choices` (and the request's prompt logprobs into `prompt_logprobs`); the
    last step (usage, timings)."""
    async for step in steps:
        for chunk in step.chunks:
            if chunk.prompt_logprobs and not prompt_logprobs:
                prompt_logprobs.extend(chunk.prompt_logprobs)
            choice = choices[chunk.index]
            choice.message.content += chunk.text
            if choice.logprobs is not None:
                choice.logprobs.content.extend(chat_logprobs(names, chunk).content)
            if chunk.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = chunk.finish_reason, chunk.stop_reason
        if step.usage is not None:
            return step
    raise RuntimeError("generation ended without usage")  # generate() always ends with usage


def _finish_choice(choice: ChatChoice, parser: ToolParser | None, reasoner: ReasoningParser | None) -> None:
    """A whole reply: the thinking out of its text into message.reasoning_content, then the calls
    out of the rest into message.tool_calls (finish_reason "tool_calls")."""
    if reasoner is not None and choice.message.content is not None:
        choice.message.reasoning_content, choice.message.content = reasoner.extract_reasoning(choice.message.content)
    if choice.message.content is None or parser is None:
        return
    content, calls = parser.extract_tool_calls(choice.message.content)
    if calls:
        choice.message.content = content
        choice.message.tool_calls = parser.kept(calls)
        if choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"


async def _stream(first: GenerationStep, steps: AsyncIterator[GenerationStep], body: ChatCompletionRequest,
                  names: Tokenizer, request_id: str, model: str,
                  parsers: list[ToolParser] | None, reasoners: list[ReasoningParser] | None,
                  with_timings: bool) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())

    def chunk_of(choices: list[ChatStreamChoice], usage=None, timings=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                   usage=usage, timings=timings)

    # OpenAI's first chunk of each choice carries the role only.
    yield chunk_of([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    for i in range(body.n)])
    step: GenerationStep | None = first
    while step is not None:
        deltas = []
        for c in step.chunks:
            reasoning, text = (reasoners[c.index].stream(c.text, c.finish_reason is not None)
                               if reasoners is not None else ("", c.text))
            text, calls, finish_reason = (parsers[c.index].extract_tool_calls_streaming(text, c.finish_reason)
                                          if parsers is not None else (text, None, c.finish_reason))
            if text or reasoning or calls or finish_reason or (body.logprobs and c.token_ids):
                deltas.append(ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=text or (None if calls or reasoning else ""),
                                                      reasoning_content=reasoning or None, tool_calls=calls),
                    logprobs=chat_logprobs(names, c) if body.logprobs else None,
                    finish_reason=finish_reason, stop_reason=c.stop_reason))
        timings = timings_of(step, with_timings)  # on the stream's last chunk
        if deltas:
            continuous = body.continuous_usage and step.progress is not None
            yield chunk_of(deltas, usage_info(step.progress) if continuous else None,
                           None if body.include_usage else timings)
        if step.usage is not None and (body.include_usage or (timings is not None and not deltas)):
            yield chunk_of([], usage_info(step.usage) if body.include_usage else None, timings)
        step = await anext(steps, None) if step.usage is None else None
