"""Tool-call formats, one `ToolParser` class each, registered by their `--tool-call-parser` name
(vLLM's `entrypoints/openai/tool_parsers/`). Importing the package registers every format:
`ToolParserManager.get_tool_parser(name)` gives its class. `auto` (auto_select.py) is not a format:
it picks one of them from the model's chat template."""

from gateway.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    StreamedToolCalls,
    ToolParser,
    ToolParserManager,
)
from gateway.openai.tool_parsers.auto_select import AUTO, selected_tool_parser, tool_parser_for_template
from gateway.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from gateway.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from gateway.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from gateway.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = ["AUTO", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "PythonicToolParser", "StreamedToolCalls", "ToolParser", "ToolParserManager", "selected_tool_parser",
           "tool_parser_for_template"]
