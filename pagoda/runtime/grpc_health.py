"""grpc.health.v1 helpers shared by the services, the launcher and the tests.

Servers: `HealthState` wraps the asyncio HealthServicer and flips the whole server ("") and the
named service together. Clients: `wait_until_serving` polls Check with a deadline (no fixed sleeps).
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthState:
    """The health of one grpc.aio server: NOT_SERVING until `set_serving(True)`."""

    def __init__(self, service_name: str) -> None:
        self.servicer = health.aio.HealthServicer()
        self._names = ("", service_name)
        self.serving = False

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        for name in self._names:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)


async def check(channel: grpc.aio.Channel, service: str = "", timeout: float = 1.0) -> int | None:
    """The served status, or None when the server does not answer."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.aio.AioRpcError:
        return None
    return reply.status


async def wait_until_serving(target: str, deadline_s: float, service: str = "",
                             poll_s: float = 0.05) -> None:
    """Poll `target` until it reports SERVING; TimeoutError after `deadline_s` seconds."""
    end = time.monotonic() + deadline_s
    async with grpc.aio.insecure_channel(target) as channel:
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{target} not SERVING after {deadline_s:.1f}s")
            if await check(channel, service, timeout=min(1.0, remaining)) == SERVING:
                return
            await asyncio.sleep(poll_s)  # a poll interval, not synchronisation: the deadline bounds it


def wait_until_serving_sync(target: str, deadline_s: float, service: str = "") -> None:
    asyncio.run(wait_until_serving(target, deadline_s, service))
