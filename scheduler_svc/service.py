"""The Engine servicer: Generate / Abort / EndSession / Migrate / SaveSession / RestoreSession / GetInfo /
GetStats, thin over the engine loop.

Each method: validate -> convert -> call the engine -> convert back. Domain errors become gRPC
statuses through the one table in pagoda/errors.py. A Generate call that ends before its request
finished (client cancelled, deadline, disconnect) aborts the request at once.
"""

from __future__ import annotations

import time

import grpc

from pagoda.contract.error_table import grpc_status_for
from pagoda.contract.errors import WorkerUnavailableError
from pagoda.contract.ids import RequestId
from pagoda.contract.step import WorkerInfo
from pagoda.runtime.logging import bound_contextvars, get_logger
from pagoda.runtime.telemetry import context_from_grpc_metadata
from pagoda.v1 import engine_pb2, engine_pb2_grpc
from scheduler_svc import convert
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.kv_pulls import KvPulls
from scheduler_svc.session_snapshots import SessionSnapshots
from scheduler_svc.worker_client import WorkerClient

log = get_logger(__name__)


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """End the call with the status the error table gives `error` (raises)."""
    code, details = grpc_status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("request_failed", error=str(error))
    await context.abort(code, details)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Registered before the server starts; answers UNAVAILABLE until `attach` (worker Init done)."""

    def __init__(self) -> None:
        self._engine_or_none: EngineLoop | None = None
        self._info: WorkerInfo | None = None
        self._snapshots: SessionSnapshots | None = None
        self._kv_pulls = KvPulls(None, None)

    def attach(self, engine: EngineLoop, info: WorkerInfo, client: WorkerClient | None = None) -> None:
        self._engine_or_none, self._info = engine, info
        self._snapshots = SessionSnapshots(engine, client) if client is not None else None
        self._kv_pulls = KvPulls(client, info)  # --kv-transfer grpc: continuations' KV, worker to worker

    @property
    def _engine(self) -> EngineLoop:
        if self._engine_or_none is None:
            raise WorkerUnavailableError("the scheduler is waiting for its worker")
        return self._engine_or_none

    async def Generate(self, request: engine_pb2.GenerateRequest, context):
        try:
            engine_request = convert.request_from_pb(
                request, arrival_time=time.time(), vocab_size=self._info.vocab_size if self._info else 0)
            engine_request = await self._kv_pulls.prepare(engine_request)  # before admission: off the steps
            stream = self._engine.add_request(  # the gateway's span is the parent (traceparent)
                engine_request, trace_parent=context_from_grpc_metadata(context.invocation_metadata()))
        except Exception as error:  # noqa: BLE001 - mapped by the error table
            await abort_with(context, error)
        request_id = engine_request.request_id
        with bound_contextvars(request_id=request_id):
            finished = False
            try:
                while not finished:
                    update = await stream.queue.get()
                    if isinstance(update, Exception):
                        finished = True
                        await abort_with(context, update)
                    finished = update.finished
                    yield convert.response_to_pb(request_id, update.deltas, update.finished,
                                                 update.queue_seconds, update.timings)
            finally:
                if not finished:  # cancelled by the client: free its blocks now
                    self._engine.abort(request_id, reason="client_cancelled")

    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        if self._engine_or_none is None:
            return engine_pb2.AbortResponse(found=False)
        found = self._engine.abort(RequestId(request.request_id), reason="abort_rpc")
        return engine_pb2.AbortResponse(found=found)

    async def EndSession(self, request: engine_pb2.EndSessionRequest, context) -> engine_pb2.EndSessionResponse:
        if self._engine_or_none is None:
            return engine_pb2.EndSessionResponse(found=False)
        found = self._engine.end_session(request.cache_salt or None, request.session_id)
        return engine_pb2.EndSessionResponse(found=found)

    async def Migrate(self, request: engine_pb2.MigrateRequest, context) -> engine_pb2.MigrateResponse:
        """Live migration: the request's stream ends with MIGRATED and its KV handoff (engine_loop)."""
        try:
            accepted = self._engine.migrate(RequestId(request.request_id))
        except Exception as error:  # noqa: BLE001 - mapped by the error table
            await abort_with(context, error)
        return engine_pb2.MigrateResponse(accepted=accepted)

    async def SaveSession(self, request: engine_pb2.SessionRequest, context) -> engine_pb2.SessionSnapshot:
        """Write the session lease's blocks as a snapshot (session_snapshots.py)."""
        try:
            return await self._session_snapshots.save(request.cache_salt or None, request.session_id)
        except Exception as error:  # noqa: BLE001 - mapped by the error table
            await abort_with(context, error)

    async def RestoreSession(self, request: engine_pb2.SessionRequest, context) -> engine_pb2.SessionSnapshot:
        """Load a session snapshot into this replica's prefix cache, leased again for ttl_s."""
        try:
            return await self._session_snapshots.restore(request.cache_salt or None, request.session_id,
                                                         request.ttl_s, request.tenant)
        except Exception as error:  # noqa: BLE001 - mapped by the error table
            await abort_with(context, error)

    @property
    def _session_snapshots(self) -> SessionSnapshots:
        if self._snapshots is None:
            raise WorkerUnavailableError("the scheduler is waiting for its worker")
        return self._snapshots

    async def GetInfo(self, request, context) -> engine_pb2.EngineInfo:
        if self._info is None:
            await abort_with(context, WorkerUnavailableError("the scheduler is waiting for its worker"))
        return convert.info_to_pb(self._info, self._engine.scheduler.config)

    async def GetStats(self, request, context) -> engine_pb2.EngineStats:
        if self._engine_or_none is None:
            return engine_pb2.EngineStats(worker_connected=False)
        engine = self._engine
        idle = engine.idle
        if idle:
            engine.check_invariants()
        stats = convert.stats_to_pb(
            engine.scheduler.stats(), num_total_blocks=engine.scheduler.config.num_blocks,
            num_steps=engine.num_steps, idle=idle, invariant_ok=engine.invariant_ok,
            request_success=engine.request_success, worker_connected=engine.connected,
            step_seconds_sum=engine.step_seconds_sum)
        stats.worker_resident_requests = engine.worker_resident_requests
        pulls = self._kv_pulls
        stats.kv_pulls, stats.kv_pull_fallbacks, stats.kv_pull_bytes = pulls.num_pulls, pulls.num_fallbacks, pulls.num_bytes
        return stats
