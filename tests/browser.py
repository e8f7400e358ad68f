"""A headless Chromium for the chat page's browser test, driven by its chromedriver over the W3C
WebDriver protocol (plain HTTP + JSON, spoken here with httpx: no driver library to install).

Where the browser comes from: `chromium` and `chromedriver` on PATH (`apt-get install chromium
chromium-driver`), else Debian's packages unpacked by `make chromium` (run by .ci/run) into
build/chromium, with the shared libraries it unpacked next to them. PAGODA_CHROMIUM_DIR names
another such unpacked tree. `find_chromium()` is None when neither has one: the test skips."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
UNPACKED = Path(os.environ.get("PAGODA_CHROMIUM_DIR") or REPO / "build" / "chromium")
DEADLINE_S = 30.0


@dataclass(frozen=True)
class Chromium:
    browser: str
    driver: str
    env: dict[str, str]


def find_chromium() -> Chromium | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if browser and driver:
        return Chromium(browser, driver, dict(os.environ))
    # Debian's /usr/bin/chromium is a wrapper script: the unpacked tree runs the binary itself.
    browser, driver = UNPACKED / "usr/lib/chromium/chromium", UNPACKED / "usr/bin/chromedriver"
    if not (os.access(browser, os.X_OK) and os.access(driver, os.X_OK)):
        return None
    libs = [UNPACKED / "usr/lib/x86_64-linux-gnu", UNPACKED / "usr/lib/x86_64-linux-gnu/pulseaudio",
            UNPACKED / "usr/lib/chromium"]
    path = ":".join([*map(str, libs), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
    return Chromium(str(browser), str(driver), {**os.environ, "LD_LIBRARY_PATH": path})


def _poll(predicate, what: str, deadline_s: float = DEADLINE_S):
    end = time.monotonic() + deadline_s
    while not (value := predicate()):
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not reached after {deadline_s}s")
        time.sleep(0.05)  # poll interval; the deadline bounds the wait
    return value


class Browser:
    """One chromedriver process and one headless session; `close()` ends both."""

    def __init__(self, chromium: Chromium, port: int, log_path: Path, size: tuple[int, int] = (1000, 700)) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([chromium.driver, f"--port={port}"], env=chromium.env,
                                         stdout=log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        self.session = ""
        try:
            _poll(self._driver_ready, "chromedriver ready")
            args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    f"--window-size={size[0]},{size[1]}"]
            options = {"binary": chromium.browser, "args": args}
            value = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": options}}})
            self.session = value["sessionId"]
        except BaseException:
            self.close()
            raise

    def _driver_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"chromedriver exited ({self.proc.returncode}): {self.log_path.read_text()[-2000:]}")
        try:
            return bool(self.http.get("/status").json()["value"]["ready"])
        except httpx.HTTPError:
            return False

    def _call(self, method: str, path: str, body: dict | None = None):
        response = self.http.request(method, path, json=body)
        value = response.json()["value"]
        if response.status_code != 200:
            raise RuntimeError(f"WebDriver {method} {path}: {value}")
        return value

    def _session(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)

    def get(self, url: str) -> None:
        self._session("POST", "/url", {"url": url})

    def run(self, script: str, *args):
        """The value of a JavaScript function body run in the page (`arguments[i]`: args)."""
        return self._session("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, script: str, what: str, *args, deadline_s: float = DEADLINE_S):
        """Polls the page until `script` returns something truthy, and returns it."""
        return _poll(lambda: self.run(script, *args), what, deadline_s)

    def _element(self, css: str) -> str:
        found = self._session("POST", "/element", {"using": "css selector", "value": css})
        return next(iter(found.values()))  # {"element-6066-...": id}

    def type(self, css: str, text: str) -> None:
        """Keystrokes into the element (WebDriver keys: "\\ue007" Enter, "\\ue008" Shift)."""
        self._session("POST", f"/element/{self._element(css)}/value", {"text": text})

    def click(self, css: str) -> None:
        self._session("POST", f"/element/{self._element(css)}/click", {})

    def screenshot(self) -> bytes:
        return base64.b64decode(self._session("GET", "/screenshot"))

    def close(self) -> None:
        try:
            if self.session:
                self._call("DELETE", f"/session/{self.session}")
        finally:
            self.http.close()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
