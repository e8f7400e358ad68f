"""OpenAI's tool-calling shapes: the request's `tools` / `tool_choice`, the reply's `tool_calls`."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # arguments always match `parameters` when the call is forced

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall

    @staticmethod
    def of(name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(function=FunctionCall(name=name, arguments=text))


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @staticmethod
    def whole(index: int, call: ToolCall) -> DeltaToolCall:
        """One delta carrying a complete call (clients concatenate deltas by index)."""
        return DeltaToolCall(index=index, id=call.id, type="function",
                             function=DeltaFunctionCall(name=call.function.name,
                                                        arguments=call.function.arguments))
