"""What every reasoning format knows (vLLM's `ReasoningParser`), and the registry of formats by name
(vLLM's `ReasoningParserManager`, looked up by `--reasoning-parser`).

A reasoning model writes its thinking between a start and an end tag (`<think>` … `</think>`), then
its answer. A parser splits a reply into reasoning and content, streamed or whole. Both ways run
the same state machine (the whole reply is one delta), so a streamed reply always adds up to the
whole one, wherever the deltas cut the tags. One instance per choice: it keeps that choice's state.

- opening: nothing but blanks read yet; a start tag here opens the reasoning. Blanks and a prefix
  of the start tag are held back until that is decided. Anything else: the reply has no start tag,
  and the format says whether it began inside the reasoning (`implicit_start`, DeepSeek-R1, whose
  template writes `<think>` into the prompt) or has none (Qwen3 with `enable_thinking` false).
- reasoning: text until the end tag; a tail that may be the start of the end tag is held back.
- content: everything after the end tag (the tool-call parser reads only this).
A reply cut before its end tag (max_tokens counts reasoning tokens too) is all reasoning.

`count_reasoning_tokens` says how many of a reply's tokens its thinking took (the Responses API's
`reasoning_tokens`, Anthropic's `thinking_tokens`): the tags count with it, as Anthropic counts
"the thinking-block delimiter tokens", so output tokens - reasoning tokens are the answer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple

from gateway.openai.parser_registry import ParserRegistry


class SplitText(NamedTuple):
    reasoning: str  # thinking, tags removed
    content: str  # the answer


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag` (it may be cut)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    name: ClassVar[str]  # the --reasoning-parser value (set by ReasoningParserManager.register_module)
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    implicit_start: ClassVar[bool]  # a reply without a start tag began inside the reasoning

    def __init__(self) -> None:
        self.state = "opening"
        self.held = ""  # text read but not given out yet: the tags may be in it
        self.thought = False  # the reply has a thinking span (its state was "reasoning" once)

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply: (reasoning, content), None for a part that is empty."""
        reasoning, content = self.stream(text, last=True)
        return reasoning or None, content or None

    def feed(self, delta: str) -> SplitText:
        """The next delta of the reply: what can be given out now as reasoning and as content."""
        text, self.held = self.held + delta, ""
        reasoning = ""
        if self.state == "opening":
            blanks = text[:len(text) - len(text.lstrip())]
            rest = text[len(blanks):]
            if rest.startswith(self.start_tag):
                self.state, text = "reasoning", rest[len(self.start_tag):]
            elif self.start_tag.startswith(rest):  # blanks only, or the start tag cut short
                self.held = text
                return SplitText("", "")
            elif self.implicit_start:
                self.state = "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            self.thought = True
            end = text.find(self.end_tag)
            if end < 0:
                keep = partial_suffix(text, self.end_tag)
                self.held = text[len(text) - keep:]
                return SplitText(text[:len(text) - keep], "")
            reasoning, text, self.state = text[:end], text[end + len(self.end_tag):], "content"
        return SplitText(reasoning, text)

    def stream(self, delta: str, last: bool) -> SplitText:
        """A streamed reply's next delta; `last`: the reply ends with it (the held text goes out)."""
        split = self.feed(delta)
        if not last:
            return split
        tail = self.flush()
        return SplitText(split.reasoning + tail.reasoning, split.content + tail.content)

    def flush(self) -> SplitText:
        """The reply ended: the held text, as what it was inside of (blanks before anything: content)."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "opening" and self.implicit_start and held.strip()):
            self.thought = True
            return SplitText(held, "")
        return SplitText("", held)

    @property
    def thinking(self) -> bool:
        """Inside the thinking span now (or not yet past its opening)."""
        return self.state != "content"

    @classmethod
    def count_reasoning_tokens(cls, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
        """How many of a reply's tokens its thinking took, tags included: 0 without thinking,
        every token when the thinking never closed, else the shortest prefix whose text closes it
        (a binary search: a prefix that closes it has every longer one close it too)."""
        whole = cls()
        whole.stream(decode(token_ids), last=True)
        if not whole.thought:
            return 0
        if whole.state != "content":
            return len(token_ids)
        low, high = 1, len(token_ids)  # the shortest closing prefix is in [low, high]
        while low < high:
            middle = (low + high) // 2
            prefix = cls()
            prefix.feed(decode(token_ids[:middle]))
            if prefix.state == "content":
                high = middle
            else:
                low = middle + 1
        return low


class ReasoningParserManager(ParserRegistry, kind="reasoning parser"):
    """The reasoning formats by their `--reasoning-parser` name, in registration order."""

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        return cls.get(name)
