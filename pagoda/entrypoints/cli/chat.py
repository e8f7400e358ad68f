"""`pagoda chat`: a quick terminal chat with a running server. Each line read is one user turn,
sent with the whole conversation so far to /v1/chat/completions (the `openai` client, streamed);
the reply is printed as it arrives and kept in the history. EOF (Ctrl-D) or Ctrl-C ends it
(exit 0); Ctrl-C during a reply stops that reply and the chat."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:8000/v1"
PROMPT = "> "


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "chat", help="chat with a running server from the terminal",
        description="Chat with a running Pagoda (or any OpenAI-compatible) server: one line per turn, "
                    "the reply streams back; the conversation is kept. Ctrl-D or Ctrl-C ends it.")
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"the server's OpenAI API base URL; /v1 is added when missing (default: {DEFAULT_URL})")
    p.add_argument("--model", default=None, help="the model to ask (default: the first of /v1/models)")
    p.add_argument("--system", default=None, help="a system prompt that opens the conversation")
    p.add_argument("--max-tokens", type=int, default=None, help="the most tokens per reply")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy)")
    p.add_argument("--api-key", default=None,
                   help="the server's API key (default: $OPENAI_API_KEY, else none)")
    p.set_defaults(handler=main_with)
    return p


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def make_client(url: str, api_key: str | None) -> Any:
    from openai import OpenAI  # here: `pagoda serve` and `pagoda --help` do not pay for it

    return OpenAI(base_url=base_url(url), api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY")


class Chat:
    """One conversation: `messages` is what the next request sends."""

    def __init__(self, client: Any, model: str, system: str | None = None, max_tokens: int | None = None,
                 temperature: float | None = None) -> None:
        self.client, self.model = client, model
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.options = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature))
                        if v is not None}

    def send(self, text: str, out: TextIO) -> str:
        """Ask `text`; print the reply to `out` as it streams and return it. The exchange joins the
        history only once the reply is complete (an error or Ctrl-C leaves the history as it was)."""
        self.messages.append({"role": "user", "content": text})
        parts: list[str] = []
        try:
            with self.client.chat.completions.create(model=self.model, messages=self.messages, stream=True,
                                                     **self.options) as stream:
                for chunk in stream:
                    for choice in chunk.choices:  # none in a usage-only chunk
                        if choice.delta.content:
                            out.write(choice.delta.content)
                            out.flush()
                            parts.append(choice.delta.content)
        except BaseException:
            self.messages.pop()
            if parts:  # end the partial reply's line
                out.write("\n")
                out.flush()
            raise
        out.write("\n")
        out.flush()
        reply = "".join(parts)
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def read_turn(stdin: TextIO, stdout: TextIO) -> str:
    """The next line (EOFError at the end); with a terminal, through `input` (line editing)."""
    if stdin is sys.stdin and stdout is sys.stdout and stdin.isatty():
        return input(PROMPT)
    line = stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def main_with(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None,
              stderr: TextIO | None = None) -> int:
    import openai

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    client = make_client(args.url, args.api_key)
    try:
        model = args.model or first_model(client)
    except (openai.APIError, LookupError) as exc:
        print(f"pagoda chat: no model at {base_url(args.url)}: {exc}", file=stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    chat = Chat(client, model, args.system, args.max_tokens, args.temperature)
    print(f"pagoda chat: {model} at {base_url(args.url)} (Ctrl-D or Ctrl-C ends)", file=stderr, flush=True)
    while True:
        try:
            text = read_turn(stdin, stdout)
            if not text.strip():
                continue
            chat.send(text, stdout)
        except (EOFError, KeyboardInterrupt):
            if stdin.isatty():
                stdout.write("\n")
            return 0
        except openai.APIConnectionError as exc:
            print(f"pagoda chat: lost {base_url(args.url)}: {exc}", file=stderr)
            return 1
        except openai.APIError as exc:  # this turn failed (e.g. too long); the chat goes on
            print(f"pagoda chat: {exc}", file=stderr, flush=True)


def first_model(client: Any) -> str:
    models = client.models.list().data
    if not models:
        raise LookupError("/v1/models lists none")
    return models[0].id
