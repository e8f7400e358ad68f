"""What every tool-call format knows (vLLM's `ToolParser`), and the registry of formats by name
(vLLM's `ToolParserManager`, looked up by `--tool-call-parser`).

A format is one subclass; everything about it lives there:
- the prompt: how tools and past calls reach a chat template that does not know tools
  (`render_tools_as_text`; a template that knows them gets `tools=`), and the grammar that forces
  one call in the format (`forced_call_grammar`: tool_choice "required" or a named function);
- a finished reply: its calls and the content around them (`extract_tool_calls`);
- a streamed reply: how much may flow as content now (`content_before_calls`) and which calls have
  begun (`call_names`). The base class streams with them (`extract_tool_calls_streaming`): content
  flows until a call may start; a call's header goes out once its name is known, its arguments
  when the reply is complete.
One instance per choice of a request: the streaming methods keep that choice's state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar, NamedTuple

from gateway.openai.parser_registry import ParserRegistry
from gateway.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall, ToolCall, ToolDef
from pagoda.contract.structured import JSON_OPTIONS, StructuredOutputsParams


class ExtractedToolCalls(NamedTuple):
    content: str | None  # the text around the calls (None: nothing but calls)
    tool_calls: list[ToolCall]  # empty: the reply is content only


class StreamedToolCalls(NamedTuple):
    content: str  # to stream now
    tool_calls: list[DeltaToolCall] | None  # call deltas to stream now
    finish_reason: str | None  # "tool_calls" in place of "stop" when the reply held calls


class ToolParser(ABC):
    name: ClassVar[str]  # the --tool-call-parser value (set by ToolParserManager.register_module)
    arguments_key: ClassVar[str]  # the key a call's arguments go under in this format

    def __init__(self, parallel_tool_calls: bool | None = None, tool_names: Iterable[str] | None = None) -> None:
        self.parallel_tool_calls = parallel_tool_calls  # False: at most the first call is returned
        # The tools the request offered: a format that also reads calls written outside its own
        # markers (hermes) takes those only for these names. None: not known, such forms are off.
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self.held = ""  # streamed text not sent yet: it may be (part of) a call
        self.sent_content = False  # any content streamed yet
        self.heads: list[str] = []  # the ids of the call headers streamed

    # -- the prompt ----------------------------------------------------------------------------

    @classmethod
    def render_prompt(cls, messages: list[dict[str, Any]], tools: list[ToolDef] | None,
                      chat_template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(messages, extra chat-template kwargs). A template that knows tools (it mentions `tools`)
        gets them as `tools=`; one that does not gets them, and past calls, as text."""
        if chat_template and "tools" in chat_template:
            specs = [t.model_dump(exclude_none=True) for t in tools or ()]
            return messages, ({"tools": specs} if specs else {})
        return cls.render_tools_as_text(messages, tools)

    @classmethod
    @abstractmethod
    def render_tools_as_text(cls, messages: list[dict[str, Any]], tools: list[ToolDef] | None
                             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages for a template that does not know tools: the tools listed, past calls and
        tool results written out as text."""

    @classmethod
    @abstractmethod
    def forced_call_grammar(cls, tools: list[ToolDef]) -> StructuredOutputsParams:
        """A grammar for exactly one call of one of `tools`, in this format."""

    @classmethod
    def call_schema(cls, tools: list[ToolDef]) -> dict[str, Any]:
        """The JSON schema of one call object of one of `tools`: its name, and arguments (under
        `arguments_key`) that follow the function's parameters."""
        key = cls.arguments_key
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                    key: t.function.arguments_schema()},
                  "required": ["name", key], "additionalProperties": False} for t in tools]
        return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}

    # -- a finished reply ----------------------------------------------------------------------

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls of a finished reply; text that is not a well-formed call stays content."""

    def kept(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls returned to the client (parallel_tool_calls false: the first one only)."""
        return calls[:1] if self.parallel_tool_calls is False else calls

    # -- a streamed reply ----------------------------------------------------------------------

    @abstractmethod
    def content_before_calls(self, text: str) -> int:
        """How much of a reply still being written can be streamed as content: everything before a
        call starts, less a tail that could be the start of one."""

    @abstractmethod
    def call_names(self, text: str) -> list[str]:
        """The names of the calls begun in `text` (a call's header can go out once its name is known)."""

    def extract_tool_calls_streaming(self, delta_text: str, finish_reason: str | None) -> StreamedToolCalls:
        """Feed this choice's next text delta (and its finish_reason at the end): what to stream now."""
        held = self.held + delta_text
        if finish_reason is None:
            cut = self.content_before_calls(held)
            self.held = held[cut:]
            self.sent_content |= bool(held[:cut].strip())
            return StreamedToolCalls(held[:cut], self._new_heads() or None, None)
        self.held = ""
        content, calls = self.extract_tool_calls(held)
        if not calls:
            return StreamedToolCalls(held, None, finish_reason)
        deltas = []
        for i, call in enumerate(self.kept(calls)):
            if i < len(self.heads):  # its header went out: the arguments only, under the same index
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=call.function.arguments)))
            else:
                deltas.append(DeltaToolCall.whole(i, call))
        return StreamedToolCalls(content or "", deltas, "tool_calls" if finish_reason == "stop" else finish_reason)

    def _new_heads(self) -> list[DeltaToolCall]:
        names = self.call_names(self.held)
        if self.parallel_tool_calls is False:
            names = names[:1]
        deltas = []
        for i in range(len(self.heads), len(names)):
            call = ToolCall.of(names[i], "")
            self.heads.append(call.id)
            deltas.append(DeltaToolCall(index=i, id=call.id, type="function",
                                        function=DeltaFunctionCall(name=names[i], arguments="")))
        return deltas


def call_of(value: Any, key: str) -> ToolCall | None:
    """A decoded call object {"name", key: arguments} (either key accepted); None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    return ToolCall.of(value["name"], arguments)


class ToolParserManager(ParserRegistry, kind="tool-call parser"):
    """The tool-call formats by their `--tool-call-parser` name, in registration order."""

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        return cls.get(name)
