"""Pydantic models of a Responses API request, and its reading as a chat completion request.

`input` is a string (one user message) or a list of items: messages (role user / assistant /
system / developer, content a string or `input_text` / `output_text` parts), `function_call` and
`function_call_output` items (a tool round trip). `instructions` become the first system message,
`text.format` the chat's `response_format`, function tools the chat's tools. Like the chat
route, unknown fields are a 400 naming them, and fields Pagoda cannot honour are accepted only with
their default values; what agent clients add (built-in tools, include, reasoning, client_metadata)
is accepted as client_fields.py documents.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gateway.openai.chat_messages import ChatMessage, ImageUrl, ImageUrlPart, TextPart
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.responses_api.client_fields import BuiltinTool, ReasoningConfig, check_include, tool_type
from gateway.openai.structured_outputs import JsonSchemaFormat, ResponseFormat
from gateway.openai.tool_protocol import FunctionDef, NamedFunction, NamedToolChoice, ToolDef
from pagoda.contract.errors import InvalidRequestError


class InputText(BaseModel):
    """A text part: `input_text` (the client's) or `output_text` (a reply echoed back)."""

    model_config = ConfigDict(extra="allow")  # output_text echoes annotations, logprobs
    type: Literal["input_text", "output_text"]  # images, files, audio: a 400 (the models read text)
    text: str


class InputImage(BaseModel):
    """An `input_image` part (a data URL or an http(s) URL; file_id is not served)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


def _text_parts_only(value: Any) -> Any:
    """A 400 naming the part type for content Pagoda cannot read (files, audio)."""
    for part in value if isinstance(value, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "input_image"):
            raise PydanticCustomError("unsupported_part", "only text and image parts (input_text, "
                                      "output_text, input_image) are served, not {kind}", {"kind": kind})
    return value


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="allow")  # an echoed output message carries id, status
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]

    _text_only = field_validator("content", mode="before")(_text_parts_only)

    def chat_message(self, where: str = "input") -> ChatMessage:
        content = (self.content if isinstance(self.content, str)
                   else [ImageUrlPart(image_url=ImageUrl(url=part.image_url), where=f"{where}.content[{j}]")
                         if isinstance(part, InputImage) else TextPart(text=part.text)
                         for j, part in enumerate(self.content)])
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=content)


class FunctionCallItem(BaseModel):
    """A call the model made (echoed back before its output)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model's next turn."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    _text_only = field_validator("output", mode="before")(_text_parts_only)
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningItem(BaseModel):
    """A reply's reasoning echoed back with its output: accepted and left out of the prompt (chat
    templates drop past thinking too)."""

    model_config = ConfigDict(extra="allow")  # id, summary, content, status, encrypted_content
    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="unsupported_item",
                  custom_error_message="an input item is a message, a function_call, a "
                                       "function_call_output or a reasoning item (Pagoda serves text)")]


class FunctionTool(FunctionDef):
    """A function tool in the Responses shape: the function's fields next to `type`."""

    type: Literal["function"]


# Function tools reach the model; every other type is accepted and not offered (client_fields.py).
Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[BuiltinTool, Tag("builtin")],
                 Discriminator(tool_type)]


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing_schema", "a json_schema format needs its schema")
        return self

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=self.name or "response", json_schema=self.json_schema, description=self.description,
            strict=self.strict))


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # ignored (client_fields.py)


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _only(*values: Any):
    return lambda value: _absent(value) or value in values


# field -> (is the value acceptable?, the 400 message otherwise): what Pagoda cannot honour
_ONLY_DEFAULT = {
    "store": (_only(False), "store=true is not supported: Pagoda stores no responses (send store=false)"),
    "previous_response_id": (_absent, "previous_response_id is not supported: Pagoda stores no "
                                      "responses (send the conversation as input items)"),
    "conversation": (_absent, "conversation is not supported: Pagoda stores no conversations"),
    "background": (_only(False), "background responses are not supported"),
    "truncation": (_only("disabled"), 'only truncation "disabled" is supported'),
    "prompt": (_absent, "prompt templates are not supported"),
    "top_logprobs": (_only(0), "top_logprobs is not supported on /v1/responses"),
    "max_tool_calls": (_absent, "max_tool_calls is not supported"),
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: list[InputItem] = Field(min_length=1)  # a string: one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Tool] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to obfuscate
    # informational: accepted, change no output
    metadata: Any = None
    user: str | None = None
    safety_identifier: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    client_metadata: Any = None  # Codex CLI's
    # accepted, in part honoured (client_fields.py)
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    # accepted only with their defaults (_ONLY_DEFAULT)
    store: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    truncation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _a_string_is_one_user_message(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise PydanticCustomError("input_type", "input is a string or a list of items")
        return value

    _include = field_validator("include")(check_include)

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [t for t in self.tools or () if isinstance(t, FunctionTool)]

    @model_validator(mode="after")
    def _only_defaults(self) -> ResponsesRequest:
        for name, (acceptable, message) in _ONLY_DEFAULT.items():
            owner, _, field = name.rpartition(".")
            holder = getattr(self, owner) if owner else self
            try:
                ok = holder is None or acceptable(getattr(holder, field))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise PydanticCustomError("unsupported_field", f"{name}: {message}")
        return self

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: the instructions first (a system message), calls
        folded into the assistant turn that made them, their outputs as tool messages."""
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        for i, item in enumerate(self.input):
            if isinstance(item, ReasoningItem):
                continue
            if isinstance(item, MessageItem):
                messages.append(item.chat_message(f"input[{i}]"))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1].role == "assistant":
                    messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text))
        return messages

    def chat_request(self) -> ChatCompletionRequest:
        """The same request for the chat path (validated there too: a bad value is a 400)."""
        tool_choice: Any = self.tool_choice
        if isinstance(tool_choice, FunctionToolChoice):
            tool_choice = NamedToolChoice(function=NamedFunction(name=tool_choice.name))
        tools = [ToolDef(function=FunctionDef(**t.model_dump(exclude={"type"}))) for t in self.function_tools] or None
        if tool_choice == "required" and self.tools and tools is None:
            raise InvalidRequestError('tool_choice "required" needs a function tool: the built-in tools '
                                      f"({', '.join(t.type for t in self.tools)}) are not run by Pagoda")
        text_format = self.text.format if self.text is not None else None
        try:
            return ChatCompletionRequest(
                model=self.model, messages=self.chat_messages(), max_tokens=self.max_output_tokens,
                temperature=self.temperature, top_p=self.top_p, tools=tools, tool_choice=tool_choice,
                parallel_tool_calls=self.parallel_tool_calls, stream=self.stream,
                chat_template_kwargs=self.reasoning.template_kwargs() or None if self.reasoning else None,
                response_format=text_format.response_format() if text_format is not None else None)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first.get("loc", ()))
            raise InvalidRequestError(f"{where}: {first.get('msg')}" if where else str(first.get("msg"))) from None

    def echo(self) -> dict[str, Any]:
        """The request's settings a Response object repeats."""
        format_ = (self.text.format.model_dump(by_alias=True, exclude_none=True)
                   if self.text is not None and self.text.format is not None else {"type": "text"})
        tool_choice = (self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionToolChoice)
                       else self.tool_choice or "auto")
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "tool_choice": tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "text": {"format": format_}, "metadata": self.metadata, "user": self.user,
            "store": False, "previous_response_id": None, "truncation": "disabled",
            "background": False,
            "reasoning": self.reasoning.model_dump(exclude_none=True) if self.reasoning is not None else None,
        }
