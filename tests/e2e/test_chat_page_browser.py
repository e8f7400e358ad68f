"""The chat page in a real headless Chromium against the real stack (`--fake` worker, gateway with
an API key): the page loads, the key typed into it reaches the API, Shift+Enter makes a new line
and Enter sends, and the streamed reply shown equals what the openai client gets for the same
request (the fake worker's tokens are a pure function of the prompt). The screenshot is saved to
the test's tmp dir; PAGODA_CHAT_SCREENSHOT=path copies it there too (docs/chat_page.png).

Skips when no Chromium + chromedriver is found (tests/browser.py says where it looks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from tests.browser import Browser, find_chromium
from tests.e2e.conftest import REPO, free_port
from tests.e2e.test_serve_chat import wait_serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
CHROMIUM = find_chromium()
KEY = "sk-page"
SYSTEM = "Answer in one short line."
ENTER, SHIFT, RELEASE = "\ue007", "\ue008", "\ue000"  # WebDriver key codes; RELEASE lets go of Shift


@pytest.fixture
def stack(tmp_path, tiny_model_dir):
    keys = tmp_path / "keys.jsonl"
    keys.write_text(f'{{"key": "{KEY}", "tenant": "page"}}\n')
    gateway_port = free_port()
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", str(tiny_model_dir), "--fake",
             "--device", "cpu", "--api-keys", str(keys), "--worker-port", str(free_port()),
             "--scheduler-port", str(free_port()), "--gateway-port", str(gateway_port),
             "--grpc-port", str(free_port()), "--shutdown-timeout", "5"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_serving(proc, log_path)
        yield f"http://127.0.0.1:{gateway_port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium + chromedriver: on PATH, or unpacked by `make chromium` "
                                             "into build/chromium (tests/browser.py)")
def test_the_chat_page_streams_the_reply_the_api_gives(stack, tmp_path):
    browser = Browser(CHROMIUM, free_port(), tmp_path / "chromedriver.log")
    try:
        browser.get(stack + "/")
        # Without a key the API refuses the model list, and the page says so.
        browser.wait_for("return document.getElementById('status').textContent.includes('401')", "a 401 shown")
        browser.type("#api-key", KEY)
        browser.run("document.getElementById('api-key').dispatchEvent(new Event('change'))")
        model = browser.wait_for("return document.getElementById('model').value", "the model list loaded")
        assert browser.run("return localStorage.getItem('pagoda-api-key')") == KEY
        assert browser.run("return document.getElementById('status').textContent") == ""

        browser.type("#system", SYSTEM)
        # Greedy, short: sliders are set the way a user's drag ends, with an input event.
        browser.run("for (const [id, v] of [['temperature', 0], ['max_tokens', 24]]) {"
                    "  const el = document.getElementById(id); el.value = v;"
                    "  el.dispatchEvent(new Event('input')); }")
        assert browser.run("return document.getElementById('max_tokens-value').value") == "24"
        browser.type("#input", f"Hello{SHIFT}{ENTER}{RELEASE}there{ENTER}")
        shown = browser.wait_for(
            "const done = document.querySelector('.message.assistant[data-done]');"
            "return done && {text: done.querySelector('.content').textContent, error: done.classList.contains('error'),"
            "  user: document.querySelector('.message.user .content').textContent,"
            "  input: document.getElementById('input').value, send: document.getElementById('send').disabled,"
            "  stop: document.getElementById('stop').disabled}", "the reply finished")
        screenshot = browser.screenshot()
    finally:
        browser.close()

    assert shown["user"] == "Hello\nthere"  # Shift+Enter: a new line; Enter: sent, and the box emptied
    assert shown["input"] == "" and not shown["error"]
    assert (shown["send"], shown["stop"]) == (False, True)
    client = OpenAI(base_url=stack + "/v1", api_key=KEY)
    stream = client.chat.completions.create(
        model=model, stream=True, temperature=0, top_p=1, max_tokens=24,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello\nthere"}])
    expected = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert expected and shown["text"] == expected

    assert screenshot.startswith(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "chat_page.png").write_bytes(screenshot)
    if out := os.environ.get("PAGODA_CHAT_SCREENSHOT"):
        shutil.copyfile(tmp_path / "chat_page.png", Path(out))
