"""Chat messages as clients send them: text content (parts too), tool calls and tool results."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

__all__ = ["ChatMessage", "TextPart"]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"  # images, audio, files: a 400 (the served models read text)
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # what a client echoes back (refusal, annotations...)
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result (role "tool")
    # deprecated function calling, or audio: not served, so a 400 rather than dropped
    function_call: Any = None
    audio: Any = None

    @field_validator("function_call", "audio", mode="before")
    @classmethod
    def _not_served(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise PydanticCustomError("unsupported_field", f"not supported: messages with "
                                      f"{info.field_name} (use tools / tool_calls)")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _calls_have_a_function(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        # Earlier calls are rendered into the prompt: each needs OpenAI's {"function": {"name",
        # "arguments"}}; anything else would fail deep in a template or a tool parser (a 500).
        for call in calls or ():
            function = call.get("function")
            if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                    or not isinstance(function.get("arguments", "{}"), str | dict)):
                raise PydanticCustomError("invalid_tool_call", "each of an assistant message's tool_calls "
                                          "needs function: {name: string, arguments: string}")
        return calls

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # content parts: only text is served
            content = "".join(part.text for part in content if part.type == "text")
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message
