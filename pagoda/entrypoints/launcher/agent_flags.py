"""The launcher's flags for agent clients (Codex CLI, Claude Code, the Agents SDK, LangChain,
LiteLLM): tool calling on by default, the model's id as clients name it. One group of arguments and
the gateway argv they become, kept apart from the other flags so both stay easy to read and merge.

vLLM's `serve` wants `--enable-auto-tool-choice --tool-call-parser NAME` before `tools` without a
`tool_choice` work; llama-server's `--jinja` reads the format from the chat template. `pagoda serve`
does the latter by default: auto tool choice on, the parser `auto` (the gateway picks it from each
model's chat template, gateway/openai/tool_parsers/auto_select.py). The gateway run by hand keeps
vLLM's defaults (auto tool choice off, hermes)."""

from __future__ import annotations

import argparse

# The gateway's formats (gateway.openai.tool_parsers), listed without importing the gateway;
# tests/unit/test_launcher_agent_flags.py checks that the lists agree.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")


def add_agent_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=True,
                       help='the gateway serves tool_choice "auto" (and tools sent without tool_choice, '
                            "OpenAI's and Anthropic's default); vLLM's flag, on by default here")
    group.add_argument("--no-enable-auto-tool-choice", dest="enable_auto_tool_choice", action="store_false",
                       help='tool_choice "auto" is a 400, as vLLM without --enable-auto-tool-choice')
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                       help="the model's tool-call format (vLLM's names); auto: the one its chat template "
                            "names, hermes for a template that does not know tools (default: auto)")
    group.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id clients send and /v1/models lists (default: the model path)")


def gateway_agent_argv(args: argparse.Namespace) -> list[str]:
    """The gateway's flags for the group above (each passed only when it differs from the gateway's
    own default, hermes and off)."""
    argv = ["--enable-auto-tool-choice"] if getattr(args, "enable_auto_tool_choice", True) else []
    argv += ["--tool-call-parser", getattr(args, "tool_call_parser", "auto")]
    if getattr(args, "served_model_name", None):
        argv += ["--served-model-name", args.served_model_name]
    return argv
