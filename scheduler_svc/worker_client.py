"""The scheduler's side of the worker protocol: connect + Init, and one ordered Steps stream.

`WorkerClient` owns one channel per worker (reused across reconnects, as the gRPC performance
guide advises); `StepStream` wraps one bidirectional Steps call: `send(plan)` writes without waiting
for the previous result (pipelining), `recv()` returns results in plan order. Any stream failure
or in-band rejection raises `WorkerLostError`, which the engine loop answers with a resync.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pagoda.contract import worker_codec as convert
from pagoda.contract.errors import (
    InvalidRequestError,
    SessionNotFoundError,
    SnapshotRefusedError,
    WorkerUnavailableError,
)
from pagoda.contract.step import StepPlan, StepResult, WorkerInfo
from pagoda.runtime.logging import get_logger
from pagoda.runtime.tls import aio_channel
from pagoda.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc

log = get_logger(__name__)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Reconnect quickly after a worker restart (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_SNAPSHOT_ERRORS = {grpc.StatusCode.NOT_FOUND: SessionNotFoundError,
                    grpc.StatusCode.FAILED_PRECONDITION: SnapshotRefusedError,
                    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError}


class WorkerLostError(Exception):
    """The Steps stream broke (worker died, network) or the worker rejected a plan: resync."""


class PlanRejectedError(WorkerLostError):
    def __init__(self, step_id: int, code: str, message: str) -> None:
        super().__init__(f"step {step_id} rejected ({code}): {message}")
        self.step_id, self.code, self.message = step_id, code, message


class StepStream:
    """One Steps call. Plans are stamped with the epoch of the Init that preceded the stream."""

    def __init__(self, call, epoch: int) -> None:
        self._call = call
        self.epoch = epoch
        self.worker_resident_requests = 0  # as the worker reported with its last result

    async def send(self, plan: StepPlan) -> None:
        try:
            await self._call.write(convert.plan_to_pb(plan, self.epoch))
        # A write that races the worker's end of the stream raises InvalidStateError ("RPC already
        # finished") rather than AioRpcError: it is the same lost worker, so resync, don't fail.
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            raise WorkerLostError(f"sending step {plan.step_id} failed: {error!r}") from error

    async def recv(self) -> StepResult:
        try:
            pb = await self._call.read()
        except grpc.aio.AioRpcError as error:
            raise WorkerLostError(f"Steps stream failed: {error.code().name} {error.details()}") from error
        if pb is grpc.aio.EOF:
            raise WorkerLostError("the worker closed the Steps stream")
        if pb.HasField("error"):
            code = worker_pb2.StepError.Code.Name(pb.error.code)
            raise PlanRejectedError(pb.step_id, code, pb.error.message)
        self.worker_resident_requests = pb.num_resident_requests
        return convert.result_from_pb(pb)

    def cancel(self) -> None:
        self._call.cancel()


class WorkerClient:
    def __init__(self, target: str, max_num_batched_tokens: int, max_num_seqs: int,
                 tls_ca: str | None = None) -> None:
        self.target = target
        self._channel = aio_channel(target, tls_ca, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._kv_transfer = kv_transfer_pb2_grpc.KvTransferStub(self._channel)
        self._init_request = worker_pb2.InitRequest(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        self.epoch: int | None = None
        self.info: WorkerInfo | None = None
        self._stream: StepStream | None = None

    async def connect(self, timeout_s: float | None = None) -> WorkerInfo:
        """Init the worker (a new epoch, no resident state), waiting for it to come up.

        gRPC retries the connection with backoff while we wait (`wait_for_ready`); a worker that
        answers UNAVAILABLE is retried until `timeout_s` (None: forever).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                pb = await self._stub.Init(self._init_request, wait_for_ready=True,
                                           timeout=remaining if remaining is not None else 3600)
                break
            except grpc.aio.AioRpcError as error:
                if error.code() not in _RETRYABLE:
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorkerUnavailableError(
                        f"worker {self.target} not reachable within {timeout_s:.1f}s") from error
        self.epoch, self.info = convert.info_from_pb(pb)
        log.info("worker_connected", worker=self.target, epoch=self.epoch,
                 num_blocks=self.info.num_blocks, model=self.info.model_name)
        return self.info

    async def read_snapshot(self, name: str, verify: bool = True, timeout_s: float = 60.0
                            ) -> worker_pb2.SnapshotListing:
        """What session snapshot `name` holds (Worker.ReadSnapshot); its refusals as domain errors."""
        try:
            return await self._stub.ReadSnapshot(worker_pb2.ReadSnapshotRequest(name=name, verify=verify),
                                                 timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            mapped = _SNAPSHOT_ERRORS.get(error.code(), WorkerUnavailableError)
            raise mapped(error.details() or error.code().name) from None

    async def pull_kv(self, migration_id: str, source: str, num_blocks: int, timeout_s: float
                      ) -> kv_transfer_pb2.PullKvResponse:
        """Live migration over gRPC (scheduler_svc/kv_pulls.py): the worker fetches an export from the
        source worker into its memory. Raises grpc.aio.AioRpcError with the worker's status."""
        return await self._kv_transfer.PullKv(
            kv_transfer_pb2.PullKvRequest(migration_id=migration_id, source=source, num_blocks=num_blocks,
                                          timeout_s=timeout_s), timeout=timeout_s + 5.0)

    def open_stream(self) -> StepStream:
        assert self.epoch is not None, "connect() first"
        self._stream = StepStream(self._stub.Steps(), self.epoch)
        return self._stream

    @property
    def worker_resident_requests(self) -> int:
        """Requests the worker holds state for, per its last result (0 before any step)."""
        return 0 if self._stream is None else self._stream.worker_resident_requests

    async def close(self) -> None:
        await self._channel.close()
