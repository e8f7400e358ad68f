"""The KvTransfer servicer (protos/pagoda/v1/kv_transfer.proto), beside Worker on the worker's port:
FetchKv serves this worker's exports, PullKv fetches another worker's into this one's staging memory.

Neither touches the step thread: FetchKv serialises each message's blocks on a helper thread, PullKv
runs the whole fetch on one (inbox.py), with a deadline.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from pagoda.runtime.logging import get_logger
from pagoda.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from worker_svc.kv_transfer.inbox import PullFailed
from worker_svc.kv_transfer.outbox import ExportNotFound, ForeignFingerprint
from worker_svc.kv_transfer.store import KvTransferStore
from worker_svc.kv_transfer.wire import chunks

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]  # chunks are 1 MiB: room to spare

log = get_logger(__name__)
DEFAULT_PULL_TIMEOUT_S = 60.0
_DONE = object()


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    def __init__(self, runner) -> None:
        self._runner = runner  # its store exists only after Init (the fingerprint needs the cache shape)

    async def _store(self, context) -> KvTransferStore:
        files = getattr(self._runner, "migration", None)
        store = getattr(files, "migration", None)
        if not isinstance(store, KvTransferStore):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker does not run --kv-transfer grpc (or is not initialised)")
        return store

    async def FetchKv(self, request: kv_transfer_pb2.FetchKvRequest, context):
        store = await self._store(context)
        try:
            num_blocks, blocks = store.outbox.open(request.migration_id, request.fingerprint)
        except ExportNotFound as error:
            log.warning("kv_fetch_refused", migration_id=request.migration_id, reason="not_found")
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error.args[0]))
        except ForeignFingerprint as error:
            log.warning("kv_fetch_refused", migration_id=request.migration_id, reason="fingerprint")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        started, stream, sent = time.perf_counter(), chunks(blocks, num_blocks), 0
        while (chunk := await asyncio.to_thread(next, stream, _DONE)) is not _DONE:
            sent += sum(len(piece.data) for piece in chunk.pieces)
            yield kv_transfer_pb2.KvChunk(pieces=[kv_transfer_pb2.KvPiece(index=p.index, offset=p.offset, size=p.size,
                                                                          data=p.data) for p in chunk.pieces],
                                          num_blocks=chunk.num_blocks)
        store.outbox.done(request.migration_id)
        log.info("kv_fetched", migration_id=request.migration_id, num_blocks=num_blocks, num_bytes=sent,
                 seconds=round(time.perf_counter() - started, 4))

    async def PullKv(self, request: kv_transfer_pb2.PullKvRequest, context) -> kv_transfer_pb2.PullKvResponse:
        store = await self._store(context)
        timeout_s = request.timeout_s or DEFAULT_PULL_TIMEOUT_S
        started = time.perf_counter()
        try:
            num_blocks, num_bytes = await asyncio.to_thread(
                store.inbox.pull, request.source, request.migration_id, request.num_blocks, timeout_s,
                lambda source, migration_id, timeout: fetch_kv(source, migration_id, timeout, store))
        except PullFailed as error:
            log.warning("kv_pull_failed", migration_id=request.migration_id, source=request.source,
                        code=error.code.name, error=str(error))
            await context.abort(error.code, str(error))
        seconds = time.perf_counter() - started
        log.info("kv_pulled", migration_id=request.migration_id, source=request.source, num_blocks=num_blocks,
                 num_bytes=num_bytes, seconds=round(seconds, 4))
        return kv_transfer_pb2.PullKvResponse(num_blocks=num_blocks, num_bytes=num_bytes, seconds=seconds)


def fetch_kv(source: str, migration_id: str, timeout_s: float, store: KvTransferStore):
    """The source's FetchKv stream (blocking iterator, for the inbox's helper thread); the channel
    closes when the stream ends or fails."""
    credentials = grpc.ssl_channel_credentials(Path(store.tls_ca).read_bytes()) if store.tls_ca else None
    channel = (grpc.secure_channel(source, credentials, options=CHANNEL_OPTIONS) if credentials
               else grpc.insecure_channel(source, options=CHANNEL_OPTIONS))
    with channel:
        stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
        yield from stub.FetchKv(kv_transfer_pb2.FetchKvRequest(migration_id=migration_id,
                                                               fingerprint=store.fingerprint), timeout=timeout_s)
