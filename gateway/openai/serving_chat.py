"""POST /v1/chat/completions: messages rendered with the model's chat template, replies out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.generation import (
    GenerationStep,
    SequenceChunk,
    check_structured_outputs,
    generate,
    start_request_span,
)
from gateway.openai.chat_tools import (
    ToolDeltas,
    finish_choice,
    template_messages,
    tool_plan,
    with_forced_call,
)
from gateway.openai.middleware import admit
from gateway.openai.prompt_logprobs import vllm_prompt_logprobs
from gateway.openai.protocol import ChatCompletionRequest
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
    usage_info,
)
from gateway.openai.streaming import sse_stream, until_disconnected
from gateway.openai.tool_calls import NO_TOOLS, ToolPlan
from gateway.state import GatewayState
from gateway.tokenizer import Tokenizer
from gateway.upstream.fallback import AdmitOnce, first_answer, prepend
from gateway.upstream.model_pools import ModelPool
from pagoda.contract.errors import InvalidRequestError
from pagoda.runtime.telemetry import context_from_headers


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Tokenizer,
                    plan: ToolPlan = NO_TOOLS) -> list[int]:
    messages, tool_kwargs = template_messages(body, getattr(tokenizer.hf, "chat_template", None), plan)
    try:
        return tokenizer.encode_chat(messages, body.add_generation_prompt,
                                     **tool_kwargs, **(body.chat_template_kwargs or {}))
    except ValueError as error:  # no template, or the template rejected the conversation
        raise InvalidRequestError(str(error)) from None
    except Exception as error:  # noqa: BLE001 - jinja's TemplateError and friends
        raise InvalidRequestError(f"the chat template failed: {error}") from None


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


async def create_chat_completion(body: ChatCompletionRequest, http: Request,
                                 state: GatewayState) -> Response:
    route = state.route(body.model)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    config = state.config
    plan = tool_plan(body, config.tool_call_parser, config.enable_auto_tool_choice)
    request_id = new_request_id("chatcmpl")
    admit_once = AdmitOnce(lambda r, max_model_len: admit(http, r, max_model_len))

    async def start(pool: ModelPool, _attempt: int):  # the request prepared for `pool`'s model
        tokenizer, info = pool.require_ready()
        sampling = build_sampling(body, body.effective_max_tokens, logprobs, tokenizer, info.vocab_size,
                                  body.prompt_logprobs)
        sampling = with_forced_call(sampling, plan)
        await check_structured_outputs(sampling)
        request = build_generation_input(body, request_id, chat_prompt_ids(body, tokenizer, plan), sampling,
                                         info.max_model_len)
        request, lease = admit_once(request, info.max_model_len)
        span = start_request_span("chat", pool.name, context_from_headers(http.headers), request,
                                  lease.tenant.name, route.fallback_from(pool))
        return (generate(pool.client, tokenizer, request, span, lease, model=pool.name),
                (tokenizer, request.prompt_token_ids))

    # Upstream errors before the first step keep their HTTP status (and may move to the fallback).
    answer = await first_answer(route, start, lambda first: until_disconnected(http, first))
    model, (tokenizer, prompt_ids) = answer.pool.name, answer.context
    if not body.stream:
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=""),
                              logprobs=ChatLogprobs(content=[]) if body.logprobs else None)
                   for i in range(body.n)]
        steps = prepend(answer.first, answer.steps)
        prompt_logprobs: list = []
        usage = await until_disconnected(http, _collect(steps, choices, tokenizer, prompt_logprobs))
        for choice in choices:
            finish_choice(choice, plan, body.parallel_tool_calls)
        return JSONResponse(ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage_info(usage),
            prompt_logprobs=(vllm_prompt_logprobs(tokenizer, prompt_ids, prompt_logprobs)
                             if body.prompt_logprobs is not None else None)).model_dump())
    events = _stream(answer.first, answer.steps, body, tokenizer, request_id, model,
                     ToolDeltas(body.n, plan, body.parallel_tool_calls))
    return StreamingResponse(sse_stream(events), media_type="text/event-stream")


async def _collect(steps: AsyncIterator[GenerationStep], choices: list[ChatChoice], tokenizer: Tokenizer,
                   prompt_logprobs: list):
    """Fold the steps into `choices` (and the request's prompt logprobs into `prompt_logprobs`)."""
    async for step in steps:
        for chunk in step.chunks:
            if chunk.prompt_logprobs and not prompt_logprobs:
                prompt_logprobs.extend(chunk.prompt_logprobs)
            choice = choices[chunk.index]
            choice.message.content += chunk.text
            if choice.logprobs is not None:
                choice.logprobs.content.extend(chat_logprobs(tokenizer, chunk).content)
            if chunk.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = chunk.finish_reason, chunk.stop_reason
        if step.usage is not None:
            return step.usage
    raise RuntimeError("generation ended without usage")  # generate() always ends with usage


async def _stream(first: GenerationStep, steps: AsyncIterator[GenerationStep], body: ChatCompletionRequest,
                  tokenizer: Tokenizer, request_id: str, model: str,
                  tools: ToolDeltas) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())

    def chunk_of(choices: list[ChatStreamChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                   usage=usage)

    # OpenAI's first chunk of each choice carries the role only.
    yield chunk_of([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    for i in range(body.n)])
    step: GenerationStep | None = first
    while step is not None:
        deltas = []
        for c in step.chunks:
            text, calls, finish_reason = tools.feed(c.index, c.text, c.finish_reason)
            if text or calls or finish_reason or (body.logprobs and c.token_ids):
                deltas.append(ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=text or (None if calls else ""), tool_calls=calls),
                    logprobs=chat_logprobs(tokenizer, c) if body.logprobs else None,
                    finish_reason=finish_reason, stop_reason=c.stop_reason))
        if deltas:
            continuous = body.continuous_usage and step.progress is not None
            yield chunk_of(deltas, usage_info(step.progress) if continuous else None)
        if step.usage is not None and body.include_usage:
            yield chunk_of([], usage_info(step.usage))
        step = await anext(steps, None) if step.usage is None else None
