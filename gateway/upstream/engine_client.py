"""Async client of the scheduler's pagoda.v1.Engine service; gRPC failures become GatewayErrors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import UpstreamError
from pagoda.runtime.tls import aio_channel
from pagoda.v1 import engine_pb2, engine_pb2_grpc

# Token streams and logprobs can be large; the default 4 MB cap is too small for long prompts.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Reconnect within ~2 s of a scheduler coming back: gRPC's default backoff grows to 120 s, so
    # after a long outage the gateway would stay 503 long after the scheduler is up again.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def _upstream(error: grpc.aio.AioRpcError) -> UpstreamError:
    details = error.details() or error.code().name.lower()
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        details = f"the scheduler is unavailable: {details}"
    return UpstreamError(error.code(), details)


class EngineClient:
    """One channel to the scheduler, reused by every request (create it inside the event loop)."""

    def __init__(self, target: str, timeout_s: float = 5.0, tls_ca: str | None = None) -> None:
        self.target = target
        self._timeout_s = timeout_s
        self._channel = aio_channel(target, tls_ca, options=_CHANNEL_OPTIONS)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, request: engine_pb2.GenerateRequest, metadata=()
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """Stream the responses; leaving the loop early (stop string, disconnect) cancels the
        call, which the scheduler treats as an abort that frees the request's blocks at once.
        `metadata`: (key, value) pairs sent with the call (the W3C traceparent)."""
        call = self._stub.Generate(request, metadata=tuple(metadata))
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as error:
            raise _upstream(error) from None
        finally:
            call.cancel()  # no-op when the stream already ended

    async def abort(self, request_id: str) -> bool:
        reply = await self._unary(self._stub.Abort, engine_pb2.AbortRequest(request_id=request_id))
        return reply.found

    async def migrate(self, request_id: str) -> bool:
        """Live migration: the scheduler exports the request and ends its stream with MIGRATED."""
        reply = await self._unary(self._stub.Migrate, engine_pb2.MigrateRequest(request_id=request_id))
        return reply.accepted

    async def end_session(self, session_id: str, cache_salt: str) -> bool:
        reply = await self._unary(self._stub.EndSession, engine_pb2.EndSessionRequest(
            session_id=session_id, cache_salt=cache_salt))
        return reply.found

    async def save_session(self, session_id: str, cache_salt: str, timeout_s: float = 120.0
                           ) -> engine_pb2.SessionSnapshot:
        """Session save (docs/kv_tiers.md): the lease's blocks written as a snapshot by the worker."""
        return await self._unary(self._stub.SaveSession, engine_pb2.SessionRequest(
            session_id=session_id, cache_salt=cache_salt), timeout_s)

    async def restore_session(self, session_id: str, cache_salt: str, ttl_s: float, tenant: str = "",
                              timeout_s: float = 120.0) -> engine_pb2.SessionSnapshot:
        return await self._unary(self._stub.RestoreSession, engine_pb2.SessionRequest(
            session_id=session_id, cache_salt=cache_salt, ttl_s=ttl_s, tenant=tenant), timeout_s)

    async def get_info(self) -> engine_pb2.EngineInfo:
        return await self._unary(self._stub.GetInfo, engine_pb2.GetInfoRequest())

    async def get_stats(self) -> engine_pb2.EngineStats:
        return await self._unary(self._stub.GetStats, engine_pb2.GetStatsRequest())

    async def is_serving(self) -> bool:
        """grpc.health.v1 says SERVING for the whole scheduler (False when it does not answer)."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""),
                                             timeout=self._timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def wait_for_info(self, timeout_s: float) -> engine_pb2.EngineInfo:
        """GetInfo, waiting up to `timeout_s` for the scheduler to come up (startup order)."""
        try:
            return await self._stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=timeout_s,
                                            wait_for_ready=True)
        except grpc.aio.AioRpcError as error:
            raise _upstream(error) from None

    async def _unary(self, method, request, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self._timeout_s)
        except grpc.aio.AioRpcError as error:
            raise _upstream(error) from None
