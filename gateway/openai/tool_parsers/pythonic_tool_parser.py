"""Pythonic tool calls (`--tool-call-parser pythonic`, Llama 3.2 / Llama 4's and ToolACE's format):
the reply is a Python list of calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`,
optionally between Llama 4's `<|python_start|>` and `<|python_end|>`. Argument values are literals
(strings, numbers, lists, dicts; JSON's true / false / null read as Python's). A reply that begins
as text holds no call.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from gateway.openai.tool_parsers.abstract_tool_parser import ExtractedToolCalls, ToolParser, ToolParserManager
from gateway.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from gateway.openai.tool_protocol import ToolCall, ToolDef
from pagoda.contract.structured import StructuredOutputsParams

_START, _END = "<|python_start|>", "<|python_end|>"
_HEAD = re.compile(r"(?:^\s*(?:<\|python_start\|>)?\s*\[|,)\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotACall(ValueError):
    pass


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    arguments_key = "arguments"

    @classmethod
    def render_tools_as_text(cls, messages: list[dict[str, Any]], tools: list[ToolDef] | None
                             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return HermesToolParser.render_tools_as_text(messages, tools)

    @classmethod
    def forced_call_grammar(cls, tools: list[ToolDef]) -> StructuredOutputsParams:
        """One call: its required arguments in the schema's order, each a JSON value of its schema
        (JSON's literals are read back as Python's); optional arguments are left out."""
        alternatives = []
        for tool in tools:
            schema = tool.function.arguments_schema()
            properties = schema.get("properties") or {}
            pieces = [f'"{name}=" %json {json.dumps(properties.get(name, {}))}'
                      for name in schema.get("required") or () if name in properties]
            name, separator = tool.function.name, ' ", " '
            alternatives.append(f'"{name}(" {separator.join(pieces)} ")"' if pieces else f'"{name}()"')
        return StructuredOutputsParams(grammar='start: "[" call "]"\ncall: ' + " | ".join(alternatives))

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(_START).removesuffix(_END).strip()
        if not body.startswith("["):
            return ExtractedToolCalls(text, [])
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise _NotACall
            calls = [_call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError):  # _NotACall is a ValueError
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, calls)

    def content_before_calls(self, text: str) -> int:
        if self.sent_content:  # the reply began as text: it holds no call
            return len(text)
        head = text.lstrip()[:len(_START)]  # a reply that is (or may become) a list is held whole
        return 0 if not head or head[0] == "[" or _START.startswith(head) else len(text)

    def call_names(self, text: str) -> list[str]:
        return [m.group(1) for m in _HEAD.finditer(text)]


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args:
        raise _NotACall
    name = _dotted(node.func)
    return ToolCall.of(name, {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None})


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise _NotACall


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)  # strings, numbers, tuples, True/False/None; else ValueError
