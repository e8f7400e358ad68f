"""A fleet that finds itself, with real processes: three replicas (fake worker + scheduler each)
that share one port on 127.0.0.1 / .2 / .3, a dnslib server on loopback naming them, and a gateway
started with `--scheduler dns://127.0.0.1:DNSPORT/pagoda-engine.test:PORT`.

Under a bounded load of streamed completions the DNS answer changes from {.1, .2} to {.2, .3}:
every request completes (0 failed), .3 joins the routing without a restart and serves some, and .1
is drained: the streams it held finish there, and once the gateway lists it as removed it gets
nothing more. Synchronised on what the gateway and the schedulers report (GET /admin/replicas,
GetStats), with deadlines; the load is paced (one request every PACE_S) so that it spans the change.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.e2e.conftest import free_port
from tests.e2e.gateway_conftest import start_gateway
from tests.gateway.dns_server import FleetResolver, dns_server
from tests.reliability.conftest import TOKENIZER_DIR, Stack, scheduler_process, worker_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NAME = "pagoda-engine.test"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
PACE_S = 0.04  # one request every 40 ms: ~100 requests over several seconds
DURING, AFTER = 50, 50  # requests launched around the DNS change, and once it has taken effect
CHANGE_AT = 25  # requests completed when the answer changes
MAX_TOKENS = 64  # the fake worker streams them in well under a second
LONG_EVERY, LONG_TOKENS = 4, 300  # every 4th is longer (~1 s): streams are under way at the change


def _port_free_on_every_host() -> int:
    """A port that 127.0.0.1, .2 and .3 can each bind (Linux routes all of 127/8 to loopback)."""
    for _ in range(20):
        port = free_port()
        try:
            for host in HOSTS[1:]:
                with socket.socket() as sock:
                    sock.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on 127.0.0.1-3")


def _replica(log_dir, host: str, port: int) -> Stack:
    """A fake worker (its own free port) and a scheduler listening on host:port."""
    directory = log_dir / host  # the schedulers share a port, so their log names would collide
    directory.mkdir()
    worker = worker_process(directory, free_port(), num_gpu_blocks_override=512)
    scheduler = scheduler_process(worker.target, directory, port, host=host)
    scheduler.target = f"{host}:{port}"  # health checks and GetStats go to this replica's address
    return Stack(directory, worker, scheduler)


@pytest.fixture
def fleet(tmp_path):
    port = _port_free_on_every_host()
    stacks: list[Stack] = []
    try:
        for host in HOSTS:
            stacks.append(_replica(tmp_path, host, port))
        for stack in stacks:
            stack.scheduler.wait_serving()
        yield stacks, port
    finally:
        for stack in stacks:
            stack.stop()


def _replicas(http_url: str) -> dict[str, dict]:
    pools = httpx.get(f"{http_url}/admin/replicas", timeout=5).json()["pools"]
    return {r["target"]: r for r in pools[0]["replicas"]}


def _event(process, name: str) -> dict:
    """The first structlog event `name` in a process's JSON log."""
    for line in process.log_path.read_text(errors="replace").splitlines():
        if f'"{name}"' in line:
            return json.loads(line)
    raise AssertionError(f"no {name} event in {process.log_path}")


def _finished(stack: Stack) -> int:
    return sum(stack.stats().request_success.values())


async def _until(predicate, what: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < end, f"{what}: not reached after {deadline_s}s"
        await asyncio.sleep(0.05)  # poll interval; the deadline bounds the wait


async def _stream(client: httpx.AsyncClient, http_url: str, index: int) -> str:
    """One streamed completion; "ok" when it ended once with all its tokens, else what went wrong."""
    max_tokens = LONG_TOKENS if index % LONG_EVERY == 0 else MAX_TOKENS
    body = {"prompt": [100 + index % 50] * 20 + [200 + index] * 4, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    endings = []
    async with client.stream("POST", f"{http_url}/v1/completions", json=body, timeout=60) as response:
        if response.status_code != 200:
            return f"http {response.status_code}"
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return f"error {chunk['error']}"
            for choice in chunk["choices"]:
                endings += [choice["finish_reason"]] if choice.get("finish_reason") else []
    return "ok" if endings == ["length"] else f"ended {endings}"


class Load:
    """Paced streamed completions until stopped; each one's outcome kept."""

    def __init__(self, client: httpx.AsyncClient, http_url: str) -> None:
        self.client, self.http_url = client, http_url
        self.tasks: list[asyncio.Task] = []

    def completed(self) -> int:
        return sum(t.done() for t in self.tasks)

    async def run(self, count: int) -> None:
        for _ in range(count):
            self.tasks.append(asyncio.create_task(_stream(self.client, self.http_url, len(self.tasks))))
            await asyncio.sleep(PACE_S)  # the load's arrival rate, not a synchronisation


async def test_the_replica_set_follows_the_dns_answer_under_load_without_a_failed_request(fleet, tmp_path):
    stacks, port = fleet
    old, kept, new = (f"{h}:{port}" for h in HOSTS)
    resolver = FleetResolver(NAME, HOSTS[:2], ttl=1)
    with dns_server(resolver) as dns_port:
        gateway, url = start_gateway(f"dns://127.0.0.1:{dns_port}/{NAME}:{port}", tmp_path,
                                     "--tokenizer", str(TOKENIZER_DIR), "--scheduler-dns-refresh-s", "0.5",
                                     "--replica-stats-interval", "0.1")
        try:
            await _until(lambda: {t: r["state"] for t, r in _replicas(url).items()} == {old: "serving",
                                                                                      kept: "serving"},
                         "both first replicas serving")
            baseline = [_finished(s) for s in stacks]
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
                load = Load(client, url)
                during = asyncio.create_task(load.run(DURING))
                await _until(lambda: load.completed() >= CHANGE_AT, f"{CHANGE_AT} requests completed")
                await _until(lambda: _replicas(url)[old]["in_flight"] >= 1, "a stream under way on .1")
                changed_at = time.monotonic()
                resolver.answer(HOSTS[1:])  # .3 added, .1 removed; the load goes on
                await _until(lambda: _replicas(url).get(new, {}).get("state") == "serving", "the new replica joined")
                joined_s = time.monotonic() - changed_at
                in_flight_on_old = _event(gateway, "replica_draining")["in_flight"]
                await _until(lambda: _replicas(url)[old]["state"] == "removed", "the old replica drained")
                drained_s = time.monotonic() - changed_at
                launched_by_then = len(load.tasks)
                stacks[0].wait_idle()  # its last streams retired: its count is final from here on
                old_at_removal = _finished(stacks[0])
                await during
                await load.run(AFTER)
                outcomes = await asyncio.gather(*load.tasks)
            for stack in stacks:  # a stream's last chunk can reach the client before its count
                stack.wait_idle()
        finally:
            gateway.stop()
    served = [_finished(s) - b for s, b in zip(stacks, baseline, strict=True)]
    failed = [o for o in outcomes if o != "ok"]
    print(f"\nDNS discovery under load: {len(outcomes)} requests, {len(failed)} failed; served per replica "
          f".1/.2/.3 = {served}; .1 held {in_flight_on_old} streams when its drain began; .3 serving "
          f"{joined_s:.2f} s and .1 removed {drained_s:.2f} s after it, {launched_by_then} launched by then")
    assert not failed, failed  # the streams .1 held when it left the answer finished too
    assert in_flight_on_old >= 1
    assert sum(served) == len(outcomes)  # every request served exactly once, by one of the three
    assert served[2] > 0  # the added replica took traffic without a restart
    assert _finished(stacks[0]) == old_at_removal  # the removed one got nothing after its drain
    assert old_at_removal - baseline[0] > 0 and served[1] > 0
