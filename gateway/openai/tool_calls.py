"""Tool calling: tools into the prompt, the model's calls out of its text, calls forced by grammar.

- Prompt: a chat template that knows tools (it mentions `tools`) gets them as `tools=`; one that
  does not (SmolLM2's plain ChatML) gets the Hermes system block listing them, and past tool turns
  rendered as Hermes text (`<tool_call>` in the assistant turn, `<tool_response>` in the tool's).
- Parsers (`--tool-call-parser`, vLLM's names): `hermes` (`<tool_call>{"name", "arguments"}
  </tool_call>`, any number, text around them is content) and `llama3_json` (the reply is a JSON
  object `{"name", "parameters"}`, several separated by `;`, optionally after `<|python_tag|>`).
- `tool_choice`: "none" calls nothing; "auto" lets the model choose (needs
  `--enable-auto-tool-choice`, as vLLM); "required" and a named function force a call in the
  parser's format with a grammar whose arguments follow the function's JSON schema, so the
  arguments are always valid JSON of the right shape.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.openai.tool_protocol import NamedToolChoice, ToolCall, ToolDef
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.structured import JSON_OPTIONS, StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>{tools}</tools> For each function call return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>')


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools mean for it: the parser (None: no tool calls expected) and the
    grammar that forces a call (None: the model chooses)."""

    parser: str | None
    forced: StructuredOutputsParams | None = None


NO_TOOLS = ToolPlan(None)


def plan_tools(tools: list[ToolDef] | None, tool_choice: Any, parser: str,
               auto_enabled: bool) -> ToolPlan:
    if not tools or tool_choice == "none":
        return ToolPlan(None)
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == tool_choice.function.name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names {tool_choice.function.name!r}, which is not in tools")
        return ToolPlan(parser, forced_call_grammar(chosen, parser))
    if tool_choice == "required":
        return ToolPlan(parser, forced_call_grammar(tools, parser))
    if not auto_enabled:  # "auto", or tools without tool_choice (OpenAI's default is auto)
        raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                  "--tool-call-parser to be set (or use tool_choice \"required\" "
                                  "or a named function)")
    return ToolPlan(parser)


def forced_call_grammar(tools: list[ToolDef], parser: str) -> StructuredOutputsParams:
    """A grammar for exactly one call of one of `tools`, in the parser's format."""
    key = "arguments" if parser == "hermes" else "parameters"
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                key: t.function.arguments_schema()},
              "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
    if parser == "llama3_json":
        return StructuredOutputsParams(json=schema)
    return StructuredOutputsParams(
        grammar=f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}')


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_messages(messages: list[dict[str, Any]], tools: list[ToolDef] | None,
                    native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template kwargs). Native: tools go to the template; else Hermes text."""
    specs = [t.model_dump(exclude_none=True) for t in tools or ()]
    if native:
        return messages, ({"tools": specs} if specs else {})
    out = []
    for message in messages:
        calls = message.pop("tool_calls", None)
        if calls:
            text = "\n".join(f"<tool_call>\n{json.dumps(_call_json(c))}\n</tool_call>" for c in calls)
            message = {**message, "content": ((message.get("content") or "") + "\n" + text).strip()}
        if message["role"] == "tool":
            message = {"role": "tool", "content": f"<tool_response>\n{message.get('content') or ''}\n"
                                                  "</tool_response>"}
        out.append(message)
    if specs:
        block = HERMES_SYSTEM.format(tools=" ".join(json.dumps(s) for s in specs))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    return {"name": function.get("name"), "arguments": arguments}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def extract_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply; text that is not a well-formed call stays content."""
    if parser == "hermes":
        calls = []
        for match in _HERMES.finditer(text):
            call = _parse_call(match.group(1), "arguments")
            if call is None:
                return text, []
            calls.append(call)
        content = _HERMES.sub("", text).strip() if calls else text
        return content or None, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_of(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\n;":
            pos += 1
    return None, calls


def _parse_call(text: str, key: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(text), key)
    except ValueError:
        return None


def _call_of(value: Any, key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    return ToolCall.of(value["name"], arguments)


def content_before_calls(text: str, parser: str) -> int:
    """How much of a reply still being written can be streamed as content: everything before a
    call starts, less a tail that could be the start of one."""
    if parser == "llama3_json":  # a reply that is (or may become) JSON is held whole
        head = text.lstrip()[:len("<|python_tag|>")]
        return 0 if not head or head[0] == "{" or "<|python_tag|>".startswith(head) else len(text)
    start = text.find("<tool_call>")
    if start >= 0:
        return start
    for keep in range(min(len(text), len("<tool_call>") - 1), 0, -1):
        if "<tool_call>".startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
