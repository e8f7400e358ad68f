"""A real Prometheus (Debian's binary, `make prometheus-tools`) scrapes a real gateway on loopback and
evaluates deploy/prometheus/alerts.yml; a forced overload makes PagodaQueueDepthHigh fire, read back
through Prometheus' own HTTP API (/api/v1/alerts).

The rule keeps its expression; only its numbers are scaled (more than 2 waiting for 3 s instead of
64 for 2 minutes: the same overload for minutes would cost this 2-core machine minutes of CPU).
Every other rule is loaded as written, and Prometheus must accept the whole file.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import pytest
import yaml

from tests.e2e.conftest import REPO, free_port
from tests.prometheus_tools import prometheus_tool
from tests.reliability.conftest import start_stack

PROMETHEUS = prometheus_tool("prometheus")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus binary (make prometheus-tools unpacks Debian's package; "
                              "apt-get install prometheus also works)")]
RULES = "deploy/prometheus/alerts.yml"
ALERT = "PagodaQueueDepthHigh"
OVERLOAD = 12  # long requests on a one-sequence scheduler: 11 of them wait
SCALED = {"> 64": "> 2", "2m": "3s"}  # threshold and `for`


def _scaled_rules(path) -> dict:
    rules = yaml.safe_load((REPO / RULES).read_text())
    [rule] = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == ALERT]
    assert "> 64" in rule["expr"] and rule["for"] == "2m", rule  # what SCALED rewrites
    rule["expr"] = rule["expr"].replace("> 64", SCALED["> 64"])
    rule["for"] = SCALED["2m"]
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return rules


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("live-prometheus"), scheduler_flags={"max_num_seqs": 1})
    yield stack
    stack.stop()


@pytest.fixture
def prometheus(gateway, tmp_path):
    rules = _scaled_rules(tmp_path / "alerts.yml")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(tmp_path / "alerts.yml")],
              "scrape_configs": [{"job_name": "pagoda", "metrics_path": "/metrics",
                                  "static_configs": [{"targets": [gateway.http_url.removeprefix("http://")]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _api(url, "targets")["activeTargets"][0]["health"] == "up", "the gateway scraped", proc)
        yield url, rules
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


class _NotReady(Exception):
    """Prometheus answered, but not yet with its API (503 "Service Unavailable" while it starts)."""


def _api(url: str, path: str) -> dict:
    response = httpx.get(f"{url}/api/v1/{path}", timeout=5)
    if response.status_code == 503:
        raise _NotReady(response.text)
    reply = response.json()
    assert reply["status"] == "success", reply
    return reply["data"]


def _until(predicate, what: str, proc: subprocess.Popen, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, f"prometheus exited ({proc.returncode}) before {what}"
        try:
            if predicate():
                return
        except (httpx.TransportError, _NotReady, IndexError, KeyError):
            pass  # not answering yet
        assert time.monotonic() < end, f"not {what} after {deadline_s}s"
        time.sleep(0.25)  # poll; bounded by the deadline


def _alert(url: str) -> dict | None:
    return next((a for a in _api(url, "alerts")["alerts"] if a["labels"]["alertname"] == ALERT), None)


async def _overload(http_url: str, stop: asyncio.Event) -> None:
    """OVERLOAD clients that each send long streams back to back until `stop`: they queue behind the
    one running. Each resends when its stream ends, because the stack's fake worker writes 1000 tokens
    in a third of a second: one round of OVERLOAD requests drains in seconds, shorter than a scrape,
    an evaluation and the rule's `for` together on a loaded machine."""
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            async with client.stream("POST", f"{http_url}/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for _ in response.aiter_lines():
                    if stop.is_set():
                        return  # leaving cancels the request upstream

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(OVERLOAD)]
        await stop.wait()
        await asyncio.gather(*tasks)  # a client that failed raises here


async def test_a_forced_overload_fires_the_queue_depth_alert_in_a_real_prometheus(prometheus, gateway):
    url, rules = prometheus
    loaded = {r["name"] for g in _api(url, "rules")["groups"] for r in g["rules"]}
    assert loaded == {r["alert"] for g in rules["groups"] for r in g["rules"]}  # the whole file
    assert _alert(url) is None  # idle: quiet
    stop = asyncio.Event()
    load = asyncio.create_task(_overload(gateway.http_url, stop))
    try:
        end = time.monotonic() + 150  # scrapes and rule evaluations slow down on a loaded CI machine
        while (alert := _alert(url)) is None or alert["state"] != "firing":
            assert time.monotonic() < end, f"{ALERT} never fired: {alert}"
            if load.done():
                load.result()  # a client's failure, raised here
                raise AssertionError("the overload ended before the alert fired")
            await asyncio.sleep(0.5)  # poll; bounded by the deadline
    finally:
        stop.set()
        await load
    assert alert["labels"]["severity"] == "warning" and alert["labels"]["model_name"]
    assert float(alert["value"]) > 2
    assert "requests waiting on" in alert["annotations"]["summary"]
