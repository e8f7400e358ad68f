"""Tool-call formats, one `ToolParser` class each, registered by their `--tool-call-parser` name
(vLLM's `entrypoints/openai/tool_parsers/`). Importing the package registers every format:
`ToolParserManager.get_tool_parser(name)` gives its class."""

from gateway.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    StreamedToolCalls,
    ToolParser,
    ToolParserManager,
)
from gateway.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from gateway.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser

__all__ = ["ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "StreamedToolCalls", "ToolParser",
           "ToolParserManager"]
