"""Hermes tool calls (`--tool-call-parser hermes`, NousResearch's format, Qwen's too): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them, and text around
them is content.

Small models also write the call in other tags, in a code fence, or as a bare JSON object: those
are read too for the tools the request offered (hermes_scan.py, as llama.cpp's Hermes 2 Pro parser).

It is also the text every chat template that does not know tools gets (SmolLM2's plain ChatML):
the Hermes system block listing the tools, past calls as `<tool_call>` text in the assistant turn
and tool results as `<tool_response>` in the tool's.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.openai.tool_parsers.abstract_tool_parser import ExtractedToolCalls, ToolParser, ToolParserManager
from gateway.openai.tool_parsers.hermes_scan import CALL, OPEN, first_open, scan
from gateway.openai.tool_protocol import ToolDef
from pagoda.contract.structured import StructuredOutputsParams
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>{tools}</tools> For each function call return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>')


@ToolParserManager.register_module("hermes")
class HermesToolParser(ToolParser):
    arguments_key = "arguments"

    @classmethod
    def render_tools_as_text(cls, messages: list[dict[str, Any]], tools: list[ToolDef] | None
                             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        specs = [t.model_dump(exclude_none=True) for t in tools or ()]
        out = []
        for message in messages:
            calls = message.pop("tool_calls", None)
            if calls:
                text = "\n".join(f"<tool_call>\n{json.dumps(_call_json(c), ensure_ascii=False)}\n</tool_call>" for c in calls)
                message = {**message, "content": ((message.get("content") or "") + "\n" + text).strip()}
            if message["role"] == "tool":
                message = {"role": "tool", "content": f"<tool_response>\n{message.get('content') or ''}\n"
                                                      "</tool_response>"}
            out.append(message)
        if specs:
            block = HERMES_SYSTEM.format(tools=" ".join(json.dumps(s, ensure_ascii=False) for s in specs))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, {}

    @classmethod
    def forced_call_grammar(cls, tools: list[ToolDef]) -> StructuredOutputsParams:
        schema = cls.call_schema(tools)
        return StructuredOutputsParams(
            grammar=f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}')

    # The calls are found by hermes_scan.py, which also takes the forms small models write outside
    # `<tool_call>` (other tags, code fences, a bare object) for the tools the request offered.
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls, pieces, pos, outside = [], [], 0, []
        for found in scan(text, self.tool_names, final=True):
            if found.status == CALL:
                pieces.append(text[pos:found.start])
                calls += found.calls
                pos = found.end
                if not text.startswith("<tool_call>", found.start):
                    outside.append(text[found.start:found.start + 24])
        if not calls:
            return ExtractedToolCalls(text, [])
        if outside:  # the model does not write its format: worth knowing when choosing a model
            log.info("tool_call_outside_format", starts=outside)
        content = ("".join(pieces) + text[pos:]).strip()
        return ExtractedToolCalls(content or None, calls)

    def content_before_calls(self, text: str) -> int:
        return first_open(text, self.tool_names)

    def call_names(self, text: str) -> list[str]:
        """The calls found so far; then a `<tool_call>`'s name as soon as it is written (the other
        forms are calls only once complete: their header waits until then)."""
        names: list[str] = []
        for found in scan(text, self.tool_names, final=False):
            if found.status == CALL:
                names += [call.function.name for call in found.calls]
            elif found.status == OPEN and found.name is not None:
                names.append(found.name)
        return names


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    """A past call as the client sent it (OpenAI's shape) -> Hermes' {"name", "arguments"}."""
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    return {"name": function.get("name"), "arguments": arguments}
