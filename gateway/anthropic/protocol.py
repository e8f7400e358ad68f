"""Pydantic models of Anthropic's Messages API: the request (`MessagesRequest`) and the reply
(`MessagesResponse`, also the `message` of a stream's message_start).

An unknown field is a 400 naming it (nothing is silently ignored); content blocks the served models
cannot read (images, documents, server tools) are a 400 too.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from gateway.openai.tool_protocol import ToolCall
from gateway.stop_strings import check_stop_strings
from pagoda.contract.errors import InvalidRequestError


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="allow")  # hints all (ttl, scope): the prefix cache is automatic
    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None


class TextBlock(_Forbid):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # echoed back by clients; none are produced


class ToolUseBlock(_Forbid):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None
    # what the anthropic client's own ToolUseBlock echoes back (`block.model_dump()`): informational
    caller: Any = None
    toolset_name: str | None = None


class ToolResultBlock(_Forbid):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or ())
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Forbid):
    """A reply's thinking sent back in a later turn: accepted and left out of the prompt (chat
    templates drop past reasoning too)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking's


class ImageSource(_Forbid):
    """base64 data with its media type, or a URL (fetched by the gateway under --allowed-media-domains)."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    def as_url(self) -> str:
        if self.type == "base64":
            if not self.data or not self.media_type:
                raise InvalidRequestError("a base64 image source needs media_type and data")
            return f"data:{self.media_type};base64,{self.data}"
        if not self.url:
            raise InvalidRequestError("a url image source needs url")
        return self.url


class ImageBlock(_Forbid):
    """An image for a vision-language model (docs/vision.md)."""

    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


_SERVED_BLOCKS = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class InputMessage(_Forbid):
    # "system": a mid-conversation system message (Claude Code's beta), kept where it is (text only)
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _served_blocks(cls, message: Any) -> Any:
        content = message.get("content") if isinstance(message, dict) else None
        served = ("text",) if isinstance(message, dict) and message.get("role") == "system" else _SERVED_BLOCKS
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in served:
                raise PydanticCustomError("unsupported_content", f"content blocks of type {kind!r} are not "
                                          f"supported (served: {', '.join(served)})")
        return message


class ToolSpec(_Forbid):
    """A client tool (Anthropic's server tools, which have other `type`s, are not served)."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    # ignored (a debug log): strict is not enforced on calls the model chooses; the others are
    # client-side hints (streaming, tool search, examples)
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[Any] | None = None


class ToolChoice(_Forbid):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")  # informational, whatever it holds
    user_id: str | None = None


class ThinkingConfig(_Forbid):
    """`enabled` needs --reasoning-parser (checked by the route) and a budget_tokens below
    max_tokens (Anthropic's rule; its minimum of 1024 is not asked: small local models think
    briefly). The thinking stops at the budget (thinking.py); `adaptive` has no budget: the model
    thinks as its template says, shown as a thinking block with --reasoning-parser, and without one
    it is ignored (a debug log), as the model decides anyway."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized"] | None = None  # "omitted" (redacted thinking): not served


class JsonOutputFormat(_Forbid):
    """Structured outputs: the reply is JSON following `schema` (the OpenAI routes' response_format
    json_schema, enforced by the same grammar on the worker)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Forbid):
    format: JsonOutputFormat | None = None
    # ignored (a debug log): how long a served model thinks is its chat template's business
    effort: Literal["low", "medium", "high", "max"] | None = None


class MessagesRequest(_Forbid):
    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)  # required, as Anthropic's
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolSpec] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None  # informational
    service_tier: Literal["auto", "standard_only"] | None = None  # informational
    cache_control: CacheControl | None = None  # informational: the prefix cache is automatic
    # The model thinks or not by its chat template; "enabled" needs --reasoning-parser (checked by
    # the route) and its budget_tokens bounds the thinking (max_tokens bounds thinking and text).
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's output_config.format
    # ignored (a debug log): Pagoda edits no context (old tool results and thinking stay in the
    # prompt); a conversation too long for the context is the usual 400
    context_management: dict[str, Any] | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise PydanticCustomError("missing_budget", 'thinking of type "enabled" needs budget_tokens')
            if thinking.budget_tokens >= self.max_tokens:
                raise PydanticCustomError("budget_too_large", "thinking.budget_tokens must be less than max_tokens")
        if self.output_format is not None and self.output_config is not None and self.output_config.format:
            raise PydanticCustomError("two_formats", "send output_config.format or output_format, not both")
        return self

    @property
    def wants_thinking(self) -> bool:
        """Thinking asked for in a way that needs a reasoning model: `enabled`, with its budget."""
        return self.thinking is not None and self.thinking.type == "enabled"

    def ignored_fields(self, reasoning_parser: str | None) -> list[str]:
        """The fields present that are accepted and ignored (for the route's debug log)."""
        names = ["context_management"] if self.context_management is not None else []
        if self.output_config is not None and self.output_config.effort is not None:
            names.append("output_config.effort")
        if self.thinking is not None and self.thinking.type == "adaptive" and reasoning_parser is None:
            names.append("thinking.adaptive")
        names += [f"tools[{t.name}].{k}" for t in self.tools or ()
                  for k in ("strict", "eager_input_streaming", "defer_loading", "input_examples")
                  if getattr(t, k) is not None]
        return names

    @property
    def thinking_budget(self) -> int | None:
        return self.thinking.budget_tokens if self.thinking is not None and self.thinking.type == "enabled" else None

    @property
    def json_format(self) -> JsonOutputFormat | None:
        return self.output_format or (self.output_config.format if self.output_config is not None else None)

    @field_validator("stop_sequences")
    @classmethod
    def _bounded_stop_sequences(cls, stop: list[str] | None) -> list[str] | None:
        try:
            check_stop_strings(stop or [])
        except InvalidRequestError as error:
            raise ValueError(str(error)) from None
        return stop


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request without max_tokens (and nothing generated;
    the default leaves any thinking budget below it)."""

    max_tokens: int = Field(default=2**31 - 1, ge=1)


# -- the reply -------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class OutputTokensDetails(BaseModel):
    thinking_tokens: int  # tags included, as Anthropic counts "the thinking-block delimiter tokens"


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    output_tokens_details: OutputTokensDetails | None = None  # with --reasoning-parser (else left out)

    @model_serializer(mode="wrap")
    def _omit_absent_details(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("output_tokens_details") is None:
            data.pop("output_tokens_details", None)
        return data


class OutputText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutputThinking(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's proof of its own thinking; nothing to prove here


class OutputToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputThinking | OutputText | OutputToolUse]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


def tool_use_id(call_id: str) -> str:
    """Anthropic's tool_use id for a parsed call's id (its ids start with toolu_)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as a tool_use block's input object."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        value = {}
    return value if isinstance(value, dict) else {"value": value}


def message_content(text: str, calls: list[ToolCall], thinking: str | None = None
                    ) -> list[OutputThinking | OutputText | OutputToolUse]:
    """The thinking block (with --reasoning-parser), a text block (always, unless the reply is
    thinking or calls only), then one tool_use block per call."""
    content: list[OutputThinking | OutputText | OutputToolUse] = (
        [OutputThinking(thinking=thinking)] if thinking is not None else [])
    if text or not (calls or content):
        content.append(OutputText(text=text))
    content += [OutputToolUse(id=tool_use_id(c.id), name=c.function.name, input=tool_input(c.function.arguments))
                for c in calls]
    return content


def stop_reason(finish_reason: str | None, stop: str | int | None, has_calls: bool) -> StopReason:
    """Anthropic's stop_reason for a finished reply: "length" is max_tokens, a stop string
    stop_sequence, a reply that made calls tool_use, anything else end_turn."""
    if has_calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence"
    return "end_turn"
