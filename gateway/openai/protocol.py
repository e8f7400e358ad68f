"""Pydantic models of the OpenAI-compatible HTTP API's requests, vLLM's field names (the replies
are in responses.py).

Request fields follow the one table in `request_fields.py`: honoured, informational, or accepted
only with their default values; an unknown field is a 400 naming it (nothing is silently ignored).
Ranges are checked by the core SamplingParams.validate(), not here, so both public APIs share one
set of rules.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.openai.chat_messages import ChatMessage
from gateway.openai.request_fields import CONDITIONAL, check_conditional
from gateway.openai.structured_outputs import StructuredFields
from gateway.openai.tool_protocol import ToolChoice, ToolDef
from gateway.stop_strings import check_stop_strings
from pagoda.contract.errors import InvalidRequestError

_INT64 = 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage (so far) on every chunk, as vLLM


class _GenerationFields(StructuredFields):
    """Fields both endpoints share (OpenAI's, then vLLM's extras sent via `extra_body`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # informational (request_fields.INFORMATIONAL): accepted, change no output
    user: str | None = None
    metadata: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key) -> [-100, 100]
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # Pagoda's session lease (docs/kv_tiers.md): the history's KV stays cached for the session's next
    # turn until session_ttl seconds pass (default DEFAULT_SESSION_TTL_S) or DELETE /v1/sessions/{id}.
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    session_ttl: float | None = Field(default=None, gt=0, le=86400)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # int32 on the wire
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False  # beam search in the engine: n beams returned, best first
    length_penalty: float = 1.0  # beam ranking: cumulative logprob / output length ** this
    prompt_logprobs: int | None = None  # each prompt token's logprob + top k (non-streaming)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's)

    @field_validator(*CONDITIONAL, mode="before", check_fields=False)
    @classmethod
    def _conditional(cls, value: Any, info: ValidationInfo) -> Any:
        return check_conditional(info.field_name, value)

    @field_validator("stop")
    @classmethod
    def _bounded_stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        try:
            check_stop_strings([stop] if isinstance(stop, str) else stop or [])
        except InvalidRequestError as error:
            raise ValueError(str(error)) from None
        return stop

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _GenerationFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's: usage so far on every chunk (with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # with use_beam_search: the beam width (>= n); else only 1
    # accepted only with their defaults (request_fields.CONDITIONAL)
    suffix: Any = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_a_beam_width(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is None:
            return None
        if not info.data.get("use_beam_search") and best_of != 1:
            raise ValueError("best_of > 1 is served as beam search only: set use_beam_search "
                             "(sampling best_of candidates is not supported; use n for several samples)")
        n = info.data.get("n", 1)
        if best_of < n:
            raise ValueError(f"best_of ({best_of}) must be at least n ({n})")
        return best_of

    @property
    def beam_width(self) -> int:
        return (self.best_of or self.n) if self.use_beam_search else 0


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None  # None: "auto" when tools are given, as OpenAI
    parallel_tool_calls: bool | None = None  # False: at most the first call is returned
    # accepted only with their defaults (request_fields.CONDITIONAL)
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: Any = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def beam_width(self) -> int:
        return self.n if self.use_beam_search else 0

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest ({"prompt"}) and TokenizeChatRequest ({"messages"}) in one
    model: exactly one of the two. Other fields are accepted as vLLM accepts them (extra="allow")."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # None: vLLM's defaults, True for a prompt, False for messages (the chat template holds BOS)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]
