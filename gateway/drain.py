"""Graceful drain: count the generation requests in progress so SIGTERM can wait for them.

On SIGTERM the gateway turns not-ready (/ready 503, gRPC health NOT_SERVING), answers new API
calls 503 / UNAVAILABLE, waits until `InFlight` is zero or `--shutdown-timeout` passed, then stops
both servers. An HTTP request counts until its last body byte is sent (streams included).
"""

from __future__ import annotations

import asyncio

from gateway.grpc_api import GenerationServicer
from gateway.state import GatewayState

COUNTED_PATH_PREFIX = "/v1/"


class InFlight:
    def __init__(self) -> None:
        self.count = 0
        self._zero = asyncio.Event()
        self._zero.set()

    def enter(self) -> None:
        self.count += 1
        self._zero.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._zero.set()

    async def wait_zero(self, timeout_s: float) -> bool:
        """True when every request finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._zero.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


class InFlightMiddleware:
    """Pure ASGI: the app call returns only after a streamed body is fully sent."""

    def __init__(self, app, in_flight: InFlight) -> None:
        self.app, self.in_flight = app, in_flight

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(COUNTED_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        self.in_flight.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.leave()


class CountingGenerationServicer(GenerationServicer):
    """The public Generation servicer, counting its streams in `in_flight`."""

    def __init__(self, state: GatewayState, in_flight: InFlight) -> None:
        super().__init__(state)
        self._in_flight = in_flight

    async def Generate(self, request, context):
        self._in_flight.enter()
        try:
            async for chunk in super().Generate(request, context):
                yield chunk
        finally:
            self._in_flight.leave()
