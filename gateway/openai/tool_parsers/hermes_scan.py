"""Where a Hermes-format reply holds its calls: the format's own `<tool_call>` and the other ways
small models write them, which llama.cpp's Hermes 2 Pro parser also takes (common/chat.cpp):

- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format: any name, as before;
- the same object in `<tools>` (the tag the chat template lists the tools in: Qwen2.5-Coder-1.5B
  writes its call there) or `<function_call>`;
- the bare object `{"name": ..., "arguments"|"parameters": {...}}` (name first, as llama.cpp
  requires), in the text or in a code fence; a tag may be in a fence too (```python, ```json, ...).

Only the format's own tag trusts any name. The other forms count only when the name is one of the
tools the request offered (`names`; None: those forms are off), with a JSON object as arguments
(or JSON text of one, OpenAI's shape),
and (untagged) no key but those two: JSON in prose or code stays content.

A reply is scanned left to right. Each candidate (a fence, a `<`, a `{`) is a call, not one, or
open: the text ends before that is known. A streamed reply holds back from the first candidate not
ruled out (`first_open`); a finished one (final=True) has no open candidate: what is still
undecided at the end is content, but for a fence left unclosed after its calls."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import NamedTuple

from gateway.openai.tool_parsers.abstract_tool_parser import call_of
from gateway.openai.tool_protocol import ToolCall

CALL, NO, OPEN = "call", "no", "open"
STRICT_TAG = "tool_call"
_TAGS = (STRICT_TAG, "tools", "function_call")
_START = re.compile(r"[`<{]")  # where a candidate may begin
_FENCE = re.compile(r"```[\w+.-]*[ \t]*\n\s*")
_FENCE_OPENING = re.compile(r"`{1,3}|```[\w+.-]*[ \t]*")  # a fence whose first line is not complete
_TAG = re.compile(r"<(tool_call|tools|function_call)>\s*")
_CLOSE = re.compile(r"\s*</(?:tool_call|tools|function_call)>")
_NAME = r'((?:[^"\\]|\\.)*)'
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"' + _NAME + '"')  # an object that begins with its name


def _prefixes(tokens: list[str]) -> re.Pattern[str]:
    """A pattern matching every prefix of the tokens' concatenation (the first token required)."""
    pattern = tokens[-1]
    for token in reversed(tokens[1:-1]):
        pattern = f"{token}(?:{pattern})?"
    return re.compile(f"{tokens[0]}(?:{pattern})?")


_HEAD_SO_FAR = _prefixes([r"\{", r"\s*", '"', "n", "a", "m", "e", '"', r"\s*", ":", r"\s*", '"', _NAME])
_ARGUMENT_KEYS = ({"name", "arguments"}, {"name", "parameters"})


class Candidate(NamedTuple):
    status: str  # CALL, NO or OPEN
    start: int
    end: int  # CALL: past it (its closing tag and fence too); NO: where the scan goes on
    calls: tuple[ToolCall, ...] = ()
    name: str | None = None  # an open `<tool_call>` whose name is known (its header may go out)


def scan(text: str, names: frozenset[str] | None, final: bool) -> Iterator[Candidate]:
    """The candidates of `text` in order, up to and including the first open one."""
    pos = 0
    while (match := _START.search(text, pos)) is not None:
        found = _candidate(text, match.start(), names, final)
        yield found
        if found.status == OPEN:
            return
        pos = found.end


def first_open(text: str, names: frozenset[str] | None) -> int:
    """Where the first candidate that is (or may become) a call starts; len(text) if none."""
    for found in scan(text, names, final=False):
        if found.status != NO:
            return found.start
    return len(text)


def _candidate(text: str, i: int, names: frozenset[str] | None, final: bool) -> Candidate:
    if text[i] == "`":
        return _fenced(text, i, names, final)
    return _tagged(text, i, names, final) if text[i] == "<" else _bare(text, i, names, final, i)


def _fenced(text: str, i: int, names: frozenset[str] | None, final: bool) -> Candidate:
    """A code fence: a call if its content begins with calls (it may hold several)."""
    fence = _FENCE.match(text, i)
    if fence is None:
        if not final and _FENCE_OPENING.fullmatch(text, i):
            return Candidate(OPEN, i, len(text))
        return Candidate(NO, i, i + (3 if text.startswith("```", i) else 1))
    calls: list[ToolCall] = []
    pos = fence.end()
    while True:
        if pos == len(text):  # the fence goes on (a streamed reply) or was never closed
            if calls:
                return Candidate(CALL, i, pos, tuple(calls))
            return Candidate(NO, i, i + 3) if final else Candidate(OPEN, i, pos)
        if calls and text.startswith("```", pos):
            return Candidate(CALL, i, pos + 3, tuple(calls))
        inner = _tagged(text, pos, names, final) if text[pos] == "<" else \
            _bare(text, pos, names, final, pos) if text[pos] == "{" else Candidate(NO, pos, pos)
        if inner.status == OPEN:
            return Candidate(CALL, i, pos, tuple(calls)) if calls else inner._replace(start=i)
        if inner.status == NO:  # not (or no longer) calls: what follows them in the fence is content
            return Candidate(CALL, i, pos, tuple(calls)) if calls else Candidate(NO, i, i + 3)
        calls += inner.calls
        pos = inner.end
        while pos < len(text) and text[pos].isspace():
            pos += 1


def _tagged(text: str, i: int, names: frozenset[str] | None, final: bool) -> Candidate:
    """`<tool_call>`, `<tools>` or `<function_call>`, then a call object (and its closing tag)."""
    tag = _TAG.match(text, i)
    if tag is None:
        rest = text[i:]
        maybe = not final and any(f"<{t}>".startswith(rest) for t in _TAGS if t == STRICT_TAG or names)
        return Candidate(OPEN if maybe else NO, i, len(text) if maybe else i + 1)
    strict = tag.group(1) == STRICT_TAG
    if not strict and names is None:
        return Candidate(NO, i, i + 1)
    pos = tag.end()
    if pos == len(text) and not final:
        return Candidate(OPEN, i, pos)
    if not text.startswith("{", pos):
        return Candidate(NO, i, i + 1)
    inner = _bare(text, pos, None if strict else names, final, i, exact=False)
    if inner.status != CALL:
        return inner._replace(start=i)
    close = _CLOSE.match(text, inner.end)
    return inner._replace(end=close.end() if close else inner.end)


def _bare(text: str, i: int, names: frozenset[str] | None, final: bool, start: int,
          exact: bool = True) -> Candidate:
    """A call object at text[i] ('{'); `start`: where its candidate begins (its tag or fence).
    names None with exact: untagged calls are off; with not exact: any name (`<tool_call>`)."""
    lenient = names is not None
    if exact and not lenient:
        return Candidate(NO, start, i + 1)
    head = _HEAD.match(text, i)
    if head is None and lenient:  # a lenient form names its tool first: rule out other objects early
        so_far = _HEAD_SO_FAR.fullmatch(text, i)
        if final or so_far is None or not any(n.startswith(so_far.group(1) or "") for n in names):
            return Candidate(NO, start, i + 1)
        return Candidate(OPEN, start, len(text))
    name = _unquote(head.group(1)) if head else None
    if lenient and name not in names:
        return Candidate(NO, start, i + 1)
    try:
        value, end = json.JSONDecoder().raw_decode(text, i)
    except ValueError:  # not complete yet (or not JSON: that is known at the end)
        if final:
            return Candidate(NO, start, i + 1)
        return Candidate(OPEN, start, len(text), name=None if lenient else name)
    call = _lenient_call(value, names, exact) if lenient else call_of(value, "arguments")
    return Candidate(CALL, start, end, (call,)) if call else Candidate(NO, start, end)


def _lenient_call(value: object, names: frozenset[str], exact: bool) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    keys = set(value)
    if not any(keys == k or (not exact and keys == {"name"}) for k in _ARGUMENT_KEYS):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's own shape, JSON text (Qwen2.5-Coder writes it too)
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall.of(value["name"], arguments) if isinstance(arguments, dict) else None


def _unquote(raw: str) -> str | None:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return None
