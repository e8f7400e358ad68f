"""The gateway process on top of `tests/e2e/conftest.py`'s shared worker + scheduler.

`tests/e2e/conftest.py` registers the `gateway_stack` fixture for the whole package.
One gateway serves the whole session (like `engine_processes`): tests measure deltas, never
absolute counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest

from tests.e2e.conftest import ServiceProcess, free_port

__all__ = ["GatewayStack", "gateway_stack", "start_gateway", "wait_for"]


@dataclass(frozen=True)
class GatewayStack:
    model_dir: str
    http_url: str  # http://127.0.0.1:PORT
    grpc_target: str  # the gateway's public gRPC
    scheduler_target: str


def start_gateway(scheduler_target: str, log_dir, *extra_args: str) -> tuple[ServiceProcess, str]:
    """A gateway process; returns once its gRPC health is SERVING (scheduler connected, tokenizer
    loaded) and its HTTP port answers /ready."""
    http_port, grpc_port = free_port(), free_port()
    gateway = ServiceProcess("gateway", "gateway", [
        "--scheduler", scheduler_target, "--port", str(http_port), "--grpc-port", str(grpc_port),
        *extra_args], grpc_port, log_dir)
    gateway.wait_serving()
    http_url = f"http://127.0.0.1:{http_port}"
    gateway.wait_until(lambda: _http_ready(http_url), "HTTP ready", deadline_s=10)
    return gateway, http_url


def _http_ready(http_url: str) -> bool:
    try:
        return httpx.get(f"{http_url}/ready", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="session")
def gateway_stack(engine_processes, tmp_path_factory):
    gateway, http_url = start_gateway(engine_processes.scheduler_target, tmp_path_factory.mktemp("gw"))
    try:
        yield GatewayStack(str(engine_processes.model_dir), http_url, gateway.target,
                           engine_processes.scheduler_target)
    finally:
        gateway.stop()


def wait_for(predicate, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached before the deadline"
        time.sleep(0.05)  # a poll interval bounded by the deadline
