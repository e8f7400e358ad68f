"""The `pagoda` console script: `pagoda serve` is the launcher under another name (same flags, same
Namespace, --help grouped by service), `pagoda chat` keeps the conversation and ends cleanly.
The e2e run of both against real processes: tests/e2e/test_serve_chat.py."""

from __future__ import annotations

import importlib
import io
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from pagoda.entrypoints.cli import chat, serve
from pagoda.entrypoints.cli.main import build_parser, main, version
from pagoda.entrypoints.launcher import cli as launcher
from pagoda.entrypoints.launcher.cli import GROUPS

ROOT = Path(__file__).resolve().parents[2]


def test_the_console_script_names_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["pagoda"].partition(":")
    assert getattr(importlib.import_module(module), function) is main


@pytest.mark.parametrize("serve_argv, launcher_argv", [
    (["M"], ["--model", "M"]),
    ([], []),  # the launcher's default model
    (["--model", "M"], ["--model", "M"]),  # the launcher's spelling still works
    (["M", "--model", "M"], ["--model", "M"]),
    (["M", "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--device", "cuda"],
     ["--model", "M", "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--device", "cuda"]),
    (["--fake", "--device", "cpu", "M", "--gateway-port", "9000", "--no-gateway"],
     ["--fake", "--device", "cpu", "--model", "M", "--gateway-port", "9000", "--no-gateway"]),
    (["m.gguf", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--swap-space", "2",
      "--preemption-mode", "swap", "--speculative-config", '{"num_speculative_tokens": 3}',
      "--extra-model", "small=x", "--fallback-model", "m=small", "--routing-policy", "least-loaded",
      "--api-keys", "k.jsonl", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4",
      "--startup-timeout", "60", "--shutdown-timeout", "5", "--lora-modules", "a=p", "b=q"],
     ["--model", "m.gguf", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--swap-space", "2",
      "--preemption-mode", "swap", "--speculative-config", '{"num_speculative_tokens": 3}',
      "--extra-model", "small=x", "--fallback-model", "m=small", "--routing-policy", "least-loaded",
      "--api-keys", "k.jsonl", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4",
      "--startup-timeout", "60", "--shutdown-timeout", "5", "--lora-modules", "a=p", "b=q"]),
])
def test_serve_gives_the_launcher_the_namespace_its_own_flags_give(serve_argv, launcher_argv):
    assert serve.parse_args(serve_argv) == launcher.parse_args(launcher_argv)


def test_pagoda_serve_runs_the_launcher_with_that_namespace(monkeypatch):
    seen = []
    monkeypatch.setattr(serve, "run_launcher", lambda args: seen.append(args) or 7)
    assert main(["serve", "M", "--fake", "--tensor-parallel-size", "2"]) == 7
    assert seen == [launcher.parse_args(["--model", "M", "--fake", "--tensor-parallel-size", "2"])]


@pytest.mark.parametrize("argv, message", [
    (["a", "--model", "b"], "two models"),
    (["M", "--data-parallel-size", "0"], "--data-parallel-size must be at least 1"),
    (["M", "--dtype", "float8"], "invalid choice"),
])
def test_serve_refuses_what_the_launcher_refuses(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def _launcher_flags() -> set[str]:
    return {flag for action in launcher.build_parser()._actions for flag in action.option_strings}


def test_serve_help_groups_every_launcher_flag_by_service(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: pagoda serve [MODEL] [flags]")
    headings = [line.rstrip(":") for line in text.splitlines() if line.endswith(":") and not line[0].isspace()]
    assert headings == ["positional arguments", "options", *GROUPS]
    assert len(_launcher_flags()) > 25
    for flag in _launcher_flags():
        assert re.search(rf"^  (-h, )?{re.escape(flag)}(?=[ ,\n])", text, re.MULTILINE), flag
    # each flag under its service's heading: one spot check per group
    for heading, flag in [("model", "--fake"), ("worker", "--tensor-parallel-size"),
                          ("scheduler", "--preemption-mode"), ("gateway", "--routing-policy"),
                          ("ports", "--gateway-port"), ("process", "--data-parallel-size")]:
        start = text.index(f"\n{heading}:\n")
        following = [text.index(f"\n{h}:\n") for h in GROUPS if text.index(f"\n{h}:\n") > start]
        end = min(following, default=len(text))
        assert start < text.index(f"  {flag} ") < end, (heading, flag)


def test_serve_and_the_launcher_take_the_same_flags():
    p = build_parser()
    serve_parser = p._subparsers._group_actions[0].choices["serve"]
    assert {f for a in serve_parser._actions for f in a.option_strings} == _launcher_flags()


def test_pagoda_help_lists_the_commands_and_version_prints_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "serve" in text and "chat" in text
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagoda {version()}"
    assert version() == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


# ---- pagoda chat, against a client double -------------------------------------------------------

class FakeStream:
    def __init__(self, pieces: list[str], interrupt_after: int | None = None) -> None:
        self.pieces, self.interrupt_after, self.closed = pieces, interrupt_after, False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True

    def __iter__(self):
        for i, piece in enumerate(self.pieces):
            if i == self.interrupt_after:
                raise KeyboardInterrupt
            delta = SimpleNamespace(content=piece)
            yield SimpleNamespace(choices=[SimpleNamespace(delta=delta)])
        yield SimpleNamespace(choices=[])  # a usage-only chunk


class FakeClient:
    """/v1/models lists m1, m2; each reply is 'reply N' in two pieces; records every request."""

    def __init__(self, fail_turn: int | None = None, interrupt_turn: int | None = None) -> None:
        self.requests: list[dict] = []
        self.fail_turn, self.interrupt_turn = fail_turn, interrupt_turn
        self.models = SimpleNamespace(list=lambda: SimpleNamespace(
            data=[SimpleNamespace(id="m1"), SimpleNamespace(id="m2")]))
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **kwargs):
        turn = len(self.requests) + 1
        self.requests.append({**kwargs, "messages": [dict(m) for m in kwargs["messages"]]})
        if turn == self.fail_turn:
            raise openai.APIError("prompt too long", httpx.Request("POST", "http://x/v1/chat/completions"),
                                  body=None)
        return FakeStream(["reply ", str(turn)], interrupt_after=1 if turn == self.interrupt_turn else None)


def run_chat(monkeypatch, argv: list[str], stdin: io.StringIO, client: FakeClient) -> tuple[int, str, str]:
    made = []
    monkeypatch.setattr(chat, "make_client", lambda url, key: made.append((url, key)) or client)
    args = build_parser().parse_args(["chat", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = args.handler(args, stdin=stdin, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_chat_keeps_the_history_and_ends_at_eof(monkeypatch):
    client = FakeClient()
    code, out, err = run_chat(monkeypatch, ["--system", "Be brief.", "--max-tokens", "16", "--temperature", "0"],
                              io.StringIO("Hello\n\nAnd again?\n"), client)
    assert code == 0
    assert out == "reply 1\nreply 2\n"
    assert "m1" in err  # the first model /v1/models lists
    first, second = client.requests
    assert first["model"] == second["model"] == "m1"
    assert first["stream"] is True and first["max_tokens"] == 16 and first["temperature"] == 0.0
    assert first["messages"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hello"}]
    assert second["messages"] == [*first["messages"], {"role": "assistant", "content": "reply 1"},
                                  {"role": "user", "content": "And again?"}]


def test_chat_sends_only_the_options_given_and_the_model_asked_for(monkeypatch):
    client = FakeClient()
    code, _, _ = run_chat(monkeypatch, ["--model", "m2"], io.StringIO("Hi"), client)
    assert code == 0
    (request,) = client.requests
    assert request["model"] == "m2" and "max_tokens" not in request and "temperature" not in request
    assert request["messages"] == [{"role": "user", "content": "Hi"}]


def test_a_failed_turn_is_reported_and_left_out_of_the_history(monkeypatch):
    client = FakeClient(fail_turn=1)
    code, out, err = run_chat(monkeypatch, [], io.StringIO("too long\nshort\n"), client)
    assert code == 0 and "prompt too long" in err
    assert client.requests[1]["messages"] == [{"role": "user", "content": "short"}]
    assert out == "reply 2\n"


class InterruptingStdin(io.StringIO):
    def readline(self, *_):
        line = super().readline()
        if not line:
            raise KeyboardInterrupt
        return line


def test_ctrl_c_ends_the_chat_cleanly_at_the_prompt_and_during_a_reply(monkeypatch):
    code, out, _ = run_chat(monkeypatch, [], InterruptingStdin("Hello\n"), FakeClient())
    assert code == 0 and out == "reply 1\n"
    client = FakeClient(interrupt_turn=2)
    chat_ = chat.Chat(client, "m1")
    assert chat_.send("one", io.StringIO()) == "reply 1"
    with pytest.raises(KeyboardInterrupt):
        chat_.send("two", io.StringIO())
    assert chat_.messages == [{"role": "user", "content": "one"}, {"role": "assistant", "content": "reply 1"}]
    code, out, _ = run_chat(monkeypatch, [], io.StringIO("one\ntwo\nthree\n"), FakeClient(interrupt_turn=2))
    assert code == 0 and out == "reply 1\nreply \n"  # the partial reply, then the chat ends


def test_no_server_is_exit_1_with_the_url():
    args = build_parser().parse_args(["chat", "--url", f"http://127.0.0.1:{_closed_port()}"])
    err = io.StringIO()
    assert args.handler(args, stdin=io.StringIO("hi\n"), stdout=io.StringIO(), stderr=err) == 1
    assert "no model at http://127.0.0.1:" in err.getvalue() and "/v1" in err.getvalue()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_url_gets_v1_when_it_lacks_it():
    assert chat.base_url("http://h:8000") == "http://h:8000/v1"
    assert chat.base_url("http://h:8000/v1/") == "http://h:8000/v1"
