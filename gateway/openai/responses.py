"""Pydantic models of the OpenAI-compatible HTTP API's replies: completions and chat completions,
whole and streamed (chunks), with usage, logprobs and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from gateway.generation import GenerationStep, Usage
from gateway.openai.tool_protocol import DeltaToolCall, ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one entry of a prompt position's {token id: Logprob} map."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id: Logprob} holding
# the prompt token and the top k.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class _OmitNoPromptLogprobs(BaseModel):
    """`prompt_logprobs` (vLLM's extra) appears only when the request asked for it, `timings` only
    with --enable-request-timings."""

    @model_serializer(mode="wrap")
    def _omit_absent_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("prompt_logprobs", "timings"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class Timings(BaseModel):
    """Where a request's time went (--enable-request-timings), in milliseconds, measured by the
    scheduler; named after llama-server's `timings` where it has the figure (prompt = prefill,
    predicted = decode, cache_n = prompt tokens served from the prefix cache)."""

    queue_ms: float  # arrival to first scheduled
    prompt_n: int  # prompt tokens prefilled (cache_n not included)
    prompt_ms: float  # first scheduled to first token
    predicted_n: int  # tokens generated
    predicted_ms: float  # first token to the last
    cache_n: int
    ttft_ms: float  # arrival to first token: queue_ms + prompt_ms
    total_ms: float  # arrival to the last token: ttft_ms + predicted_ms


class CompletionChoice(_OmitNoPromptLogprobs):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_OmitNoPromptLogprobs):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class _OmitNoToolCalls(BaseModel):
    """`tool_calls` and `reasoning_content` appear only when there are some (OpenAI's messages and
    deltas omit tool_calls; a model without --reasoning-parser has no reasoning)."""

    @model_serializer(mode="wrap")
    def _omit_empty_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatResponseMessage(_OmitNoToolCalls):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's: the thinking, with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(_OmitNoPromptLogprobs):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    timings: Timings | None = None


class DeltaMessage(_OmitNoToolCalls):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_OmitNoPromptLogprobs):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None  # on the last chunk


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens))


def timings_of(step: GenerationStep, enabled: bool) -> Timings | None:
    """The HTTP `timings` of a request's last step (None: not enabled, or not the last step)."""
    if not enabled or step.timings is None or step.usage is None:
        return None
    t, usage = step.timings, step.usage
    return Timings(queue_ms=t.queue_seconds * 1e3, prompt_n=usage.prompt_tokens - usage.cached_tokens,
                   prompt_ms=t.prefill_seconds * 1e3, predicted_n=usage.completion_tokens,
                   predicted_ms=t.decode_seconds * 1e3, cache_n=usage.cached_tokens,
                   ttft_ms=t.time_to_first_token_seconds * 1e3, total_ms=t.total_seconds * 1e3)
