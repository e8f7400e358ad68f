"""DeepSeek-R1 (`--reasoning-parser deepseek_r1`): its chat template ends the prompt with `<think>`,
so a reply begins inside the reasoning and usually shows only `</think>`; a `<think>` the model
writes anyway is dropped."""

from __future__ import annotations

from gateway.openai.reasoning_parsers.abstract_reasoning_parser import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    implicit_start = True
