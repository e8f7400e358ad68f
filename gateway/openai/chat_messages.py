"""Chat messages as clients send them: text content (parts too, and `image_url` parts for a
vision-language model: gateway/multimodal.py), tool calls and tool results."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

__all__ = ["ChatMessage", "ImageUrl", "ImageUrlPart", "TextPart"]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"  # audio, files: a 400 (the served models read text and images)
    text: str = ""


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str  # a base64 data URL, or http(s) (fetched only under --allowed-media-domains)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides


class ImageUrlPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"] = "image_url"
    image_url: ImageUrl
    # Where the client put it (its 400s name the part): set by the Anthropic / Responses converters,
    # else "messages[i].content[j]" of the chat request.
    where: str | None = Field(default=None, exclude=True)


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # what a client echoes back (refusal, annotations...)
    role: str
    content: str | list[ContentPart] | None = None
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

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(part.type == "image_url" for part in self.content)

    def image_parts(self) -> list[tuple[int, ImageUrlPart]]:
        """(index in content, part) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if part.type == "image_url"]

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list) and self.has_images:  # the template writes one placeholder per image
            content = [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
                       for part in content]
        elif isinstance(content, list):
            content = "".join(part.text for part in content if part.type == "text")
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message
