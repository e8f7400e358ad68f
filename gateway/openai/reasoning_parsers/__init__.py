"""Reasoning formats, one `ReasoningParser` class each, registered by their `--reasoning-parser`
name (vLLM's `reasoning/` parsers). Importing the package registers every format:
`ReasoningParserManager.get_reasoning_parser(name)` gives its class."""

from gateway.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningParserManager,
    SplitText,
)
from gateway.openai.reasoning_parsers.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from gateway.openai.reasoning_parsers.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser", "ReasoningParserManager",
           "SplitText"]
