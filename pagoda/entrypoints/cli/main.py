"""`pagoda COMMAND ...`: the subcommands (`serve`, `chat`) and `--version`."""

from __future__ import annotations

import argparse
from importlib import metadata

from pagoda.entrypoints.cli import chat, serve


def version() -> str:
    try:
        return metadata.version("pagoda")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda", description="Pagoda, a vLLM-like LLM inference server.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = p.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)
    serve.add_parser(commands)
    chat.add_parser(commands)
    return p


def main(argv: list[str] | None = None) -> int:
    """The console script's entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.handler(args)
