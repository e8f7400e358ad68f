"""`pagoda serve MODEL --fake` brings the whole stack up (gateway included) on free ports, `pagoda chat`
holds a two-turn conversation with it over stdin, and SIGTERM stops it with exit code 0."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pagoda.entrypoints.cli import chat
from pagoda.entrypoints.cli.main import main
from tests.e2e.conftest import REPO, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
CHAT_FLAGS = ["--system", "Be brief.", "--max-tokens", "8", "--temperature", "0"]
TURNS = "Hello there\nAnd again?\n"


def wait_serving(proc: subprocess.Popen, log_path, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while "Pagoda is serving" not in log_path.read_text():
        assert proc.poll() is None, f"pagoda serve exited ({proc.returncode}):\n{log_path.read_text()}"
        assert time.monotonic() < end, f"not serving after {deadline_s}s:\n{log_path.read_text()}"
        time.sleep(0.1)  # poll interval; the deadline bounds the wait


def test_pagoda_serve_then_a_two_turn_pagoda_chat(tmp_path, tiny_model_dir, monkeypatch, capsys):
    gateway_port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from pagoda.entrypoints.cli.main import main; "
                                   "sys.exit(main(sys.argv[1:]))",
             "serve", str(tiny_model_dir), "--fake", "--device", "cpu",
             "--worker-port", str(free_port()), "--scheduler-port", str(free_port()),
             "--gateway-port", str(gateway_port), "--grpc-port", str(free_port()), "--shutdown-timeout", "5"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{gateway_port}/v1"
    try:
        wait_serving(proc, log_path)

        # The command a user types: two turns on stdin, then EOF.
        done = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "chat", "--url", url, *CHAT_FLAGS],
                              input=TURNS, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        served = httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]
        assert served in done.stderr  # the default model: the first /v1/models lists

        # The same conversation in-process, with every request body read off the wire.
        bodies = []

        def recording_client(url_: str, key: str | None):
            from openai import OpenAI

            def hook(request: httpx.Request) -> None:
                if request.method == "POST":
                    bodies.append(json.loads(request.read()))

            return OpenAI(base_url=chat.base_url(url_), api_key="EMPTY",
                          http_client=httpx.Client(event_hooks={"request": [hook]}))

        monkeypatch.setattr(chat, "make_client", recording_client)
        monkeypatch.setattr(sys, "stdin", io.StringIO(TURNS))
        assert main(["chat", "--url", url, *CHAT_FLAGS]) == 0
        out = capsys.readouterr().out
        first, second = bodies
        assert first["model"] == second["model"] == served
        assert first["stream"] is True and first["max_tokens"] == 8 and first["temperature"] == 0
        assert first["messages"] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hello there"}]
        (reply,) = [m["content"] for m in second["messages"] if m["role"] == "assistant"]
        assert second["messages"] == [*first["messages"], {"role": "assistant", "content": reply},
                                      {"role": "user", "content": "And again?"}]
        # The first reply is what was printed first; the fake worker's tokens are a pure function
        # of the prompt, so the console script printed the same conversation.
        assert reply and out.startswith(reply + "\n") and len(out) > len(reply) + 1
        assert done.stdout == out

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "[launcher] stopped" in log_path.read_text()
