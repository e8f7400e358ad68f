"""Helpers both OpenAI endpoints share: request -> GenerationInput, SSE framing, disconnects."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from gateway.errors import ClientDisconnectedError, openai_error_body, to_client_error
from gateway.generation import GenerationInput, Usage
from gateway.openai_protocol import PromptTokensDetails, UsageInfo, _GenerationFields
from gateway.tokenizer import Tokenizer
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.params import (
    SamplingParams,
    check_context_length,
    check_vocab,
    with_bad_words_tokenized,
)
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")

# Optional OpenAI/vLLM fields: None means "the core default", so they are passed only when set.
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_sampling(request: _GenerationFields, max_tokens: int | None, logprobs: int | None,
                   tokenizer: Tokenizer, vocab_size: int,
                   prompt_logprobs: int | None = None) -> SamplingParams:
    """Validate through the core SamplingParams (one set of rules); token ids against the vocab."""
    optional = {name: getattr(request, name) for name in _OPTIONAL_SAMPLING
                if getattr(request, name) is not None}
    if request.beam_width:  # ranked by the raw logprobs, as vLLM's beam search: no temperature
        optional.pop("temperature", None)
        optional.update(beam_width=request.beam_width, length_penalty=request.length_penalty)
    sampling = SamplingParams(
        n=request.n, seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens,
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        logprobs=logprobs, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, logit_bias=request.logit_bias,
        allowed_token_ids=request.allowed_token_ids, bad_words=tuple(request.bad_words or ()),
        structured_outputs=request.structured_outputs_params(), prompt_logprobs=prompt_logprobs,
        **optional)
    sampling = with_bad_words_tokenized(
        sampling, lambda text: tokenizer.encode(text, add_special_tokens=False))
    check_vocab(sampling, vocab_size)
    return sampling


def build_generation_input(request: _GenerationFields, request_id: str, prompt_ids: list[int],
                           sampling: SamplingParams, max_model_len: int) -> GenerationInput:
    """One prompt's GenerationInput; checks the context length."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt must not be empty")
    check_context_length(max_model_len, len(prompt_ids), sampling.max_tokens)
    return GenerationInput(
        request_id=request_id, prompt_token_ids=tuple(prompt_ids), sampling=sampling,
        stop=request.stop_strings(), include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens, priority=request.priority,
        cache_salt=request.cache_salt or "")


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    if vocab_size and any(not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size})")


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens))


# Legal unescaped in JSON and in SSE, but line breaks to `str.splitlines` — which is how httpx's
# `iter_lines` and many other clients split a stream: a raw U+2028 in a token's text would cut that
# `data:` line in two on their side. Inside JSON they can only occur in strings, so escaping is exact.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body.translate(_UNICODE_LINE_BREAKS)}\n\n"


async def sse_stream(events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """SSE framing: each event as `data: ...`, a failure as an error event, always `[DONE]` last.

    A client disconnect cancels this generator (CancelledError is not caught), which closes
    `events` and so cancels the upstream call.
    """
    try:
        async for event in events:
            yield sse_event(event)
    except Exception as error:  # noqa: BLE001 - headers are gone: report in-band, then [DONE]
        client_error = to_client_error(error)
        log.warning("stream_failed", error=client_error.message, status=client_error.http_status)
        yield sse_event(openai_error_body(client_error.http_status, client_error.message))
    yield "data: [DONE]\n\n"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the HTTP client goes away first (aborts upstream)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        log.info("client_disconnected", path=request.url.path)
        raise ClientDisconnectedError("client disconnected")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
