"""The chat page in a real headless Chromium against the real stack (`--fake` worker, gateway with
an API key): the page loads, the key typed into it reaches the API, Shift+Enter makes a new line
and Enter sends, and the streamed reply shown equals what the openai client gets for the same
request (the fake worker's tokens are a pure function of the prompt). The screenshot is saved to
the test's tmp dir; PAGODA_CHAT_SCREENSHOT=path copies it there too (docs/chat_page.png).
A second test replaces the page's fetch of /v1/chat/completions with a scripted stream: the
"thinking" block, SSE lines split across chunks, and Stop (the stopped reply stays in the
conversation the next request sends).

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


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    tmp_path = tmp_path_factory.mktemp("chat_page")
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


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium + chromedriver: on PATH, or unpacked by `make chromium` into "
                             "build/chromium (tests/browser.py)")


@needs_chromium
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


# A stand-in for the API's stream, so the page meets what the fake worker never sends: a
# reasoning_content delta, JSON split across network chunks, CRLF separators, and a stream that
# stays open until Stop aborts it. Requests other than chat completions go to the real gateway.
FAKE_STREAM = """
const realFetch = window.fetch;
window.sent = [];
window.fetch = (url, init) => {
  if (!String(url).endsWith('/v1/chat/completions')) return realFetch(url, init);
  window.sent.push({body: JSON.parse(init.body), headers: init.headers});
  const chunks = window.sent.length === 1
    ? ['data: {"choices":[{"delta":{"role":"assistant","reasoning_content":"Let me th',
       'ink."}}]}\\n\\ndata: {"choices":[{"delta":{"content":"Hi"}}]}\\r\\n\\r\\n',
       'data: {"choices":[{"delta":{"content":" there"}}]}\\n\\n']
    : ['data: {"choices":[{"delta":{"content":"Again"}}]}\\n\\ndata: [DONE]\\n\\n'];
  const body = new ReadableStream({start(stream) {
    for (const chunk of chunks) stream.enqueue(new TextEncoder().encode(chunk));
    if (window.sent.length > 1) stream.close();
    init.signal.addEventListener('abort', () => stream.error(new DOMException('stopped', 'AbortError')));
  }});
  return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
};
"""
REPLY_STATE = """
const items = document.querySelectorAll('.message.assistant');
const item = items[arguments[0]];
return item && {text: item.querySelector('.content').textContent, done: item.dataset.done === 'true',
  thinking: item.querySelector('.thinking').hidden ? null : item.querySelector('.thinking div').textContent,
  error: item.classList.contains('error'), send: document.getElementById('send').disabled,
  stop: document.getElementById('stop').disabled, status: document.getElementById('status').textContent};
"""


@needs_chromium
def test_thinking_is_shown_and_stop_ends_a_reply_that_stays_in_the_conversation(stack, tmp_path):
    browser = Browser(CHROMIUM, free_port(), tmp_path / "chromedriver.log")
    try:
        browser.get(stack + "/")
        browser.run(f"localStorage.setItem('pagoda-api-key', '{KEY}')")  # as a previous visit left it
        browser.get(stack + "/")
        assert browser.wait_for("return document.getElementById('model').value", "the models loaded with the key")
        browser.run(FAKE_STREAM)
        browser.type("#input", f"Think first{ENTER}")
        streaming = browser.wait_for(
            f"const s = (() => {{{REPLY_STATE}}})(); return s && s.text === 'Hi there' && s", "the streamed text", 0)
        assert streaming["thinking"] == "Let me think." and not streaming["done"]
        assert (streaming["send"], streaming["stop"]) == (True, False)  # busy: only Stop
        browser.click("#stop")
        stopped = browser.wait_for(f"const s = (() => {{{REPLY_STATE}}})(); return s && s.done && s", "stopped", 0)
        assert stopped["text"] == "Hi there" and not stopped["error"] and stopped["status"] == ""
        assert (stopped["send"], stopped["stop"]) == (False, True)

        browser.type("#input", f"And again{ENTER}")
        second = browser.wait_for(f"const s = (() => {{{REPLY_STATE}}})(); return s && s.done && s", "second reply", 1)
        assert second["text"] == "Again" and second["thinking"] is None
        first, again = browser.run("return window.sent")
    finally:
        browser.close()
    assert first["headers"]["Authorization"] == f"Bearer {KEY}"
    assert first["body"]["stream"] is True and first["body"]["top_p"] == 1
    # The stopped reply is part of the conversation the next request carries.
    assert again["body"]["messages"] == [{"role": "user", "content": "Think first"},
                                         {"role": "assistant", "content": "Hi there"},
                                         {"role": "user", "content": "And again"}]
