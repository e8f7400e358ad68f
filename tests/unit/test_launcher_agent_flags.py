"""`pagoda serve`'s agent flags (pagoda/entrypoints/launcher/agent_flags.py): tool calling on by
default, the parser picked from the chat template, --served-model-name; what reaches the gateway."""

from __future__ import annotations

from gateway.__main__ import parse_args as gateway_args
from gateway.openai.tool_parsers import AUTO, ToolParserManager
from pagoda.entrypoints.cli.serve import parse_args as serve_args
from pagoda.entrypoints.launcher.agent_flags import TOOL_CALL_PARSERS
from pagoda.entrypoints.launcher.topology import build_children


def _gateway_config(args):
    gateway = build_children(args)[-1]
    assert gateway.name == "gateway"
    return gateway_args(gateway.argv[gateway.argv.index("--scheduler"):])


def test_pagoda_serve_turns_tools_on_by_default():
    config = _gateway_config(serve_args(["--fake"]))
    assert config.enable_auto_tool_choice and config.tool_call_parser == AUTO
    assert config.served_model_name is None


def test_the_agent_flags_reach_the_gateway():
    config = _gateway_config(serve_args(["--fake", "--no-enable-auto-tool-choice", "--tool-call-parser", "mistral",
                                         "--served-model-name", "qwen-coder", "--reasoning-parser", "qwen3"]))
    assert not config.enable_auto_tool_choice and config.tool_call_parser == "mistral"
    assert config.served_model_name == "qwen-coder" and config.reasoning_parser == "qwen3"


def test_the_launcher_lists_the_gateways_formats():
    # The launcher names them without importing the gateway: the lists must agree.
    assert set(TOOL_CALL_PARSERS) == {AUTO, *ToolParserManager.names()}
