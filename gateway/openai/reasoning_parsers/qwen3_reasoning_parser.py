"""Qwen3 (`--reasoning-parser qwen3`): the reply opens its reasoning with `<think>` and closes it
with `</think>`. With `chat_template_kwargs: {"enable_thinking": false}` the template writes an
empty think block into the prompt, the reply has no tags, and it is all content."""

from __future__ import annotations

from gateway.openai.reasoning_parsers.abstract_reasoning_parser import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    implicit_start = False
