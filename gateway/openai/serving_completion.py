"""POST /v1/completions: prompt text or token ids in, completions (JSON or SSE) out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.batch_admission import admit_batch
from gateway.generation import (
    GenerationStep,
    SequenceChunk,
    check_structured_outputs,
    generate,
    start_request_span,
)
from gateway.openai.batch_prompts import merge_steps, split_prompts
from gateway.openai.middleware import admit
from gateway.openai.prompt_logprobs import add_echo_logprobs, vllm_prompt_logprobs
from gateway.openai.protocol import CompletionRequest
from gateway.openai.request_inputs import (
    build_generation_input,
    build_sampling,
    check_token_ids,
    new_request_id,
)
from gateway.openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    timings_of,
    usage_info,
)
from gateway.openai.streaming import sse_stream, until_disconnected
from gateway.state import GatewayState
from gateway.tokenizer import Tokenizer
from gateway.upstream.fallback import AdmitOnce, first_answer, prepend
from gateway.upstream.model_pools import ModelPool
from pagoda.contract.errors import InvalidRequestError
from pagoda.runtime.telemetry import context_from_headers


def prompt_token_ids(prompt: str | list[int], tokenizer: Tokenizer, vocab_size: int) -> tuple[list[int], str]:
    """(token ids, prompt text) for one prompt: a string or a token id list."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt must not be empty")
        return tokenizer.encode(prompt), prompt
    check_token_ids(prompt, vocab_size)
    return list(prompt), tokenizer.decode(prompt)


class CompletionChoices:
    """Accumulates every choice (prompts × n): text, logprobs with their text offsets, finish.

    Each choice's first delta carries what goes before its completion: with echo, the prompt's
    text and (with logprobs) its tokens' logprobs; `prompt_logprobs` (vLLM's field) lands on the
    accumulated choice only (never streamed)."""

    def __init__(self, echo_texts: list[str], tokenizer: Tokenizer, with_logprobs: bool,
                 prompt_ids: list[list[int]] | None = None, echo_logprobs: int | None = None,
                 return_prompt_logprobs: bool = False, names: Tokenizer | None = None) -> None:
        self._tokenizer = tokenizer
        self._names = names or tokenizer  # what names tokens in logprobs (return_tokens_as_token_ids)
        self._with_logprobs = with_logprobs
        self._pending_echo = list(echo_texts)  # one per choice: sent with its first delta
        self._offsets = [0] * len(echo_texts)  # length of the text each choice has so far
        self._prompt_ids = prompt_ids or [[] for _ in echo_texts]  # per choice
        self._echo_logprobs = echo_logprobs  # echo + logprobs: the prompt's top k
        self._return_prompt_logprobs = return_prompt_logprobs
        self._started = [False] * len(echo_texts)
        self.choices = [CompletionChoice(index=i, text="", logprobs=self._empty_logprobs())
                        for i in range(len(echo_texts))]

    def _empty_logprobs(self) -> CompletionLogprobs | None:
        return CompletionLogprobs() if self._with_logprobs else None

    def add(self, chunk: SequenceChunk) -> CompletionChoice:
        """Fold `chunk` into its choice; return the delta for a stream."""
        delta = CompletionChoice(index=chunk.index, text=self._pending_echo[chunk.index] + chunk.text,
                                 logprobs=self._empty_logprobs(), finish_reason=chunk.finish_reason,
                                 stop_reason=chunk.stop_reason)
        self._pending_echo[chunk.index] = ""
        if not self._started[chunk.index]:
            self._start(chunk, delta)
        if delta.logprobs is not None:
            self._add_logprobs(delta.logprobs, chunk, self._offsets[chunk.index] + len(delta.text) - len(chunk.text))
        self._offsets[chunk.index] += len(delta.text)
        choice = self.choices[chunk.index]
        choice.text += delta.text
        if choice.logprobs is not None and delta.logprobs is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(choice.logprobs, name).extend(getattr(delta.logprobs, name))
        if chunk.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = chunk.finish_reason, chunk.stop_reason
        return delta

    def _start(self, chunk: SequenceChunk, delta: CompletionChoice) -> None:
        """The choice's first delta: the echoed prompt's logprobs, vLLM's prompt_logprobs."""
        self._started[chunk.index] = True
        prompt_ids, prompt_logprobs = self._prompt_ids[chunk.index], chunk.prompt_logprobs or []
        if self._echo_logprobs is not None and delta.logprobs is not None:
            add_echo_logprobs(delta.logprobs, self._tokenizer, prompt_ids, prompt_logprobs,
                              self._echo_logprobs, self._names)
        if self._return_prompt_logprobs:
            self.choices[chunk.index].prompt_logprobs = vllm_prompt_logprobs(
                self._tokenizer, prompt_ids, prompt_logprobs)

    def _add_logprobs(self, out: CompletionLogprobs, chunk: SequenceChunk, offset: int) -> None:
        for token_id, logprob in zip(chunk.token_ids, chunk.logprobs, strict=False):
            token = self._names.token_text(token_id)
            top = {self._names.token_text(t.token_id): t.logprob for t in logprob.top}
            top.setdefault(token, logprob.logprob)
            out.tokens.append(token)
            out.token_logprobs.append(logprob.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(self._tokenizer.token_text(token_id))  # the text's offsets, whatever names it


async def create_completion(body: CompletionRequest, http: Request, state: GatewayState) -> Response:
    route = state.route(body.model)
    # vLLM's rule: echo with logprobs scores the prompt too, unless prompt_logprobs says otherwise.
    prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else (
        body.logprobs if body.echo else None)
    request_id = new_request_id("cmpl")
    admit_once = AdmitOnce(lambda r, max_model_len: admit(http, r, max_model_len))
    parent = context_from_headers(http.headers)

    async def start(pool: ModelPool, _attempt: int):  # the request prepared for `pool`'s model
        tokenizer, info = pool.require_ready()
        prompts = [prompt_token_ids(p, tokenizer, info.vocab_size) for p in split_prompts(body.prompt)]
        sampling = build_sampling(body, body.max_tokens, body.logprobs, tokenizer, info.vocab_size,
                                  prompt_logprobs)
        await check_structured_outputs(sampling)
        requests = [build_generation_input(body, request_id if len(prompts) == 1 else f"{request_id}-{k}",
                                           ids, sampling, info.max_model_len)
                    for k, (ids, _) in enumerate(prompts)]
        choices = CompletionChoices(
            [text if body.echo else "" for _, text in prompts for _ in range(body.n)],
            tokenizer, body.logprobs is not None, [ids for ids, _ in prompts for _ in range(body.n)],
            body.logprobs if body.echo else None,
            return_prompt_logprobs=prompt_logprobs is not None and not body.stream,
            names=tokenizer.logprob_names(body.return_tokens_as_token_ids))
        requests, leases = admit_batch(admit_once, requests, info.max_model_len)
        steps = merge_steps([
            generate(pool.client, tokenizer, r, start_request_span(
                "text_completion", pool.name, parent, r, lease.tenant.name, route.fallback_from(pool)),
                lease, model=pool.name)
            for r, lease in zip(requests, leases, strict=True)], body.n)
        return steps, choices

    # Upstream errors before the first step keep their HTTP status (and may move to the fallback).
    answer = await first_answer(route, start, lambda first: until_disconnected(http, first))
    model, choices = answer.pool.name, answer.context
    if not body.stream:
        last = await until_disconnected(http, _collect(prepend(answer.first, answer.steps), choices))
        return JSONResponse(CompletionResponse(
            id=request_id, model=model, choices=choices.choices, usage=usage_info(last.usage),
            timings=timings_of(last, state.config.enable_request_timings)).model_dump())
    events = _stream(answer.first, answer.steps, choices, request_id, model, body.include_usage,
                     body.continuous_usage, state.config.enable_request_timings)
    return StreamingResponse(sse_stream(events), media_type="text/event-stream")


async def _collect(steps: AsyncIterator[GenerationStep], choices: CompletionChoices):
    async for step in steps:
        for chunk in step.chunks:
            choices.add(chunk)
        if step.usage is not None:
            return step  # the last: usage, timings
    raise RuntimeError("generation ended without usage")  # generate() always ends with usage


async def _stream(first: GenerationStep, steps: AsyncIterator[GenerationStep], choices: CompletionChoices,
                  request_id: str, model: str, include_usage: bool,
                  continuous_usage: bool, with_timings: bool) -> AsyncIterator[CompletionResponse]:
    created = int(time.time())
    step: GenerationStep | None = first
    while step is not None:
        deltas = [choices.add(c) for c in step.chunks]
        deltas = [d for d in deltas if d.text or d.finish_reason or (d.logprobs and d.logprobs.tokens)]
        timings = timings_of(step, with_timings)  # on the stream's last chunk
        if deltas:
            usage = usage_info(step.progress) if continuous_usage and step.progress else None
            yield CompletionResponse(id=request_id, created=created, model=model, choices=deltas,
                                     usage=usage, timings=None if include_usage else timings)
        if step.usage is not None and (include_usage or (timings is not None and not deltas)):
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                     usage=usage_info(step.usage) if include_usage else None, timings=timings)
        step = await anext(steps, None) if step.usage is None else None
