"""Mistral tool calls (`--tool-call-parser mistral`): `[TOOL_CALLS]` then a JSON array of
`{"name", "arguments"}` objects (Mistral 7B v0.3, Mixtral, Nemo), or, from the v11 tokenizers
(Mistral Small 3.2, Devstral), `[TOOL_CALLS]name[ARGS]{...}` once per call.

`[TOOL_CALLS]` is a special token: with `skip_special_tokens` (the default) the detokenized reply no
longer holds it, so a reply that *is* a JSON array of call objects is read as calls too (what the
forced-call grammar writes, since a grammar matches text, not the special token).

Mistral's chat templates refuse tool-call ids that are not 9 alphanumeric characters; ids this
parser makes are such, and the ids other clients send back (`call_...`) are mapped to 9 characters
(a digest, the same for a call and its result) before the template sees them, as vLLM does.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from typing import Any

from gateway.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolParser,
    ToolParserManager,
    call_of,
)
from gateway.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from gateway.openai.tool_protocol import DeltaToolCall, ToolCall, ToolDef
from pagoda.contract.structured import StructuredOutputsParams

TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_ALNUM = string.ascii_letters + string.digits
# where a call's name is known: in the JSON form, or before [ARGS] in the v11 form
_HEAD = re.compile(r'(?:\[|,)\s*\{\s*"name"\s*:\s*"([^"]*)"|\[TOOL_CALLS\]\s*([A-Za-z0-9_.-]+)\s*\[ARGS\]')


def mistral_call_id(seed: str | None = None) -> str:
    """Nine alphanumeric characters: random, or a digest of `seed` (an id from another client)."""
    if seed is None:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    if len(seed) == 9 and seed.isalnum():
        return seed
    digest = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(digest >> (6 * i)) % len(_ALNUM)] for i in range(9))


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    arguments_key = "arguments"

    @classmethod
    def render_prompt(cls, messages: list[dict[str, Any]], tools: list[ToolDef] | None,
                      chat_template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return super().render_prompt([_with_mistral_ids(m) for m in messages], tools, chat_template)

    @classmethod
    def render_tools_as_text(cls, messages: list[dict[str, Any]], tools: list[ToolDef] | None
                             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        # Mistral's own templates know tools; one that does not gets the one text rendering there is.
        return HermesToolParser.render_tools_as_text(messages, tools)

    @classmethod
    def forced_call_grammar(cls, tools: list[ToolDef]) -> StructuredOutputsParams:
        # The JSON array form without the special token (a grammar matches text): read back as calls.
        return StructuredOutputsParams(grammar=f'start: "[" call "]"\ncall: %json {json.dumps(cls.call_schema(tools))}')

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(TOOL_CALLS)
        if start < 0:
            if not text.lstrip().startswith('[{"name"'):
                return ExtractedToolCalls(text, [])
            content, body = None, text.strip()
        else:
            content, body = text[:start].strip() or None, text[start + len(TOOL_CALLS):].strip()
        calls = _v11_calls(body) if _ARGS in body and not body.startswith("[") else _json_calls(body, self.arguments_key)
        if not calls:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(content, [c.model_copy(update={"id": mistral_call_id()}) for c in calls])

    def content_before_calls(self, text: str) -> int:
        start = text.find(TOOL_CALLS)
        if start >= 0:
            return start
        if not self.sent_content and text.lstrip()[:1] == "[":  # the bare JSON form: held whole
            return 0
        for keep in range(min(len(text), len(TOOL_CALLS) - 1), 0, -1):
            if TOOL_CALLS.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def call_names(self, text: str) -> list[str]:
        return [m.group(1) or m.group(2) for m in _HEAD.finditer(text)]

    def _new_heads(self) -> list[DeltaToolCall]:
        deltas = super()._new_heads()
        for delta in deltas:  # the ids a Mistral template takes back
            delta.id = mistral_call_id()
            self.heads[delta.index] = delta.id
        return deltas


def _json_calls(body: str, key: str) -> list[ToolCall]:
    try:
        value, _ = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return []
    value = value if isinstance(value, list) else [value]
    calls = [call_of(v, key) for v in value]
    return calls if calls and all(c is not None for c in calls) else []


def _v11_calls(body: str) -> list[ToolCall]:
    """`name[ARGS]{...}` pieces, each after its own [TOOL_CALLS] (the first one already cut)."""
    calls, decoder = [], json.JSONDecoder()
    for piece in body.split(TOOL_CALLS):
        name, found, arguments = piece.partition(_ARGS)
        if not found or not name.strip():
            return []
        try:
            value, _ = decoder.raw_decode(arguments.strip())
        except ValueError:
            return []
        calls.append(ToolCall.of(name.strip(), value))
    return calls


def _with_mistral_ids(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [
            {**c, "id": mistral_call_id(c["id"])} if isinstance(c, dict) and c.get("id") else c
            for c in message["tool_calls"]]}
    if message.get("role") == "tool" and message.get("tool_call_id"):
        message = {**message, "tool_call_id": mistral_call_id(message["tool_call_id"])}
    return message
