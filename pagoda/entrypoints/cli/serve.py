"""`pagoda serve [MODEL] [flags]`: the launcher (`python -m pagoda.entrypoints.launcher`) under
vLLM's command name. MODEL is positional (`--model` is still accepted); every other flag is the
launcher's own, added by its `add_flags`, so both commands always take the same flags and give
`run` the same Namespace."""

from __future__ import annotations

import argparse
from functools import partial

from pagoda.entrypoints.launcher.cli import DEFAULT_MODEL, add_flags, add_groups, check_args
from pagoda.entrypoints.launcher.cli import run as run_launcher

# What the subcommand machinery and the positional MODEL add to the launcher's Namespace.
_OWN = ("command", "handler", "model_tag")


USAGE = "pagoda serve [MODEL] [flags]"
DESCRIPTION = ("Start the whole Pagoda stack on 127.0.0.1 (the same flags as "
               "`python -m pagoda.entrypoints.launcher`), print its addresses, and serve until "
               "Ctrl-C or SIGTERM, which stop every service in order: gateway, scheduler, worker.")


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`serve` as a subcommand of `pagoda` (pagoda/entrypoints/cli/main.py)."""
    return _configure(commands.add_parser(
        "serve", usage=USAGE, help="start the whole stack on 127.0.0.1: worker, scheduler, gateway",
        description=DESCRIPTION))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The launcher's Namespace for `pagoda serve ARGV` (what `main(["serve", *argv])` runs)."""
    p = _configure(argparse.ArgumentParser(prog="pagoda serve", usage=USAGE, description=DESCRIPTION))
    return launcher_args(p, p.parse_args(argv))


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help=f"an HF-format model directory or a .gguf file (default: {DEFAULT_MODEL})")
    add_flags(add_groups(p), default=None, help="the same as MODEL (the launcher's spelling)")
    p.set_defaults(handler=partial(main_with, p))
    return p


def launcher_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The launcher's Namespace for a parsed `pagoda serve` command line (errors exit via parser)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"two models: MODEL {args.model_tag!r} and --model {args.model!r}")
    values = {k: v for k, v in vars(args).items() if k not in _OWN}
    values["model"] = args.model_tag or args.model or DEFAULT_MODEL
    launcher = argparse.Namespace(**values)
    check_args(parser, launcher)
    return launcher


def main_with(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    return run_launcher(launcher_args(parser, args))
