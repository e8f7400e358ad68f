"""Llama 3.x JSON tool calls (`--tool-call-parser llama3_json`): the reply is a JSON object
`{"name": ..., "parameters": {...}}`, several separated by `;`, optionally after `<|python_tag|>`.
A reply that begins as text holds no call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolParser,
    ToolParserManager,
    call_of,
)
from gateway.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from gateway.openai.tool_protocol import ToolDef
from pagoda.contract.structured import StructuredOutputsParams

_PYTHON_TAG = "<|python_tag|>"
_HEAD = re.compile(r'(?:^|;)\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"([^"]*)"')  # where a call's name is known


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    arguments_key = "parameters"

    @classmethod
    def render_tools_as_text(cls, messages: list[dict[str, Any]], tools: list[ToolDef] | None
                             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        # Llama 3's own templates know tools; one that does not gets the one text rendering there is.
        return HermesToolParser.render_tools_as_text(messages, tools)

    @classmethod
    def forced_call_grammar(cls, tools: list[ToolDef]) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=cls.call_schema(tools))

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text, [])
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                value, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return ExtractedToolCalls(text, [])
            call = call_of(value, self.arguments_key)
            if call is None:
                return ExtractedToolCalls(text, [])
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        return ExtractedToolCalls(None, calls)

    def content_before_calls(self, text: str) -> int:
        if self.sent_content:  # the reply began as text: it holds no call
            return len(text)
        head = text.lstrip()[:len(_PYTHON_TAG)]  # a reply that is (or may become) JSON is held whole
        return 0 if not head or head[0] == "{" or _PYTHON_TAG.startswith(head) else len(text)

    def call_names(self, text: str) -> list[str]:
        return [m.group(1) for m in _HEAD.finditer(text)]
