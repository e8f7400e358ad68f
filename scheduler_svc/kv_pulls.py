"""Live migration over gRPC on the target's scheduler (--kv-transfer grpc on the workers): before a
continuation whose handoff names a source worker is admitted, this replica's worker pulls the blocks
from it (KvTransfer.PullKv, worker to worker; the bytes never pass the scheduler), so the plan that
loads them finds them in the worker's memory and no step waits on the network.

A pull that fails (the source gone, the export unknown, expired or dropped, a refused block, the
deadline) or that this worker cannot take (it uses the shared folder) drops the import: the
continuation recomputes its context, as a failover continuation does. Logged (`kv_pull_failed`) and
counted (EngineStats.kv_pull_fallbacks), never a hung or failed request.
"""

from __future__ import annotations

import dataclasses
import time

import grpc

from pagoda.contract.step import WorkerInfo
from pagoda.runtime.logging import get_logger
from scheduler_svc.core.request import EngineRequest
from scheduler_svc.worker_client import WorkerClient

log = get_logger(__name__)
PULL_TIMEOUT_S = 60.0  # the whole fetch: a 2,000-token SmolLM2 context is 90 MB


class KvPulls:
    def __init__(self, client: WorkerClient | None, info: WorkerInfo | None, timeout_s: float = PULL_TIMEOUT_S) -> None:
        self._client, self._info, self.timeout_s = client, info, timeout_s
        self.num_pulls = 0
        self.num_fallbacks = 0
        self.num_bytes = 0

    async def prepare(self, request: EngineRequest) -> EngineRequest:
        """`request`, its KV pulled onto this worker, or without its import when that cannot be."""
        handoff = request.kv_import
        if handoff is None or handoff.snapshot or not handoff.source or not handoff.num_blocks:
            return request
        started = time.perf_counter()
        try:
            if self._client is None or self._info is None or not self._info.kv_transfer_address:
                raise RuntimeError("this worker does not run --kv-transfer grpc")
            response = await self._client.pull_kv(handoff.migration_id, handoff.source, handoff.num_blocks,
                                                  self.timeout_s)
        except Exception as error:  # noqa: BLE001 - any failure recomputes; it never fails the request
            self.num_fallbacks += 1
            reason = (f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError)
                      else str(error))
            log.warning("kv_pull_failed", request_id=request.request_id, migration_id=handoff.migration_id,
                        source=handoff.source, error=reason, fallback="recompute",
                        seconds=round(time.perf_counter() - started, 4))
            return dataclasses.replace(request, kv_import=None)
        self.num_pulls += 1
        self.num_bytes += response.num_bytes
        log.info("kv_pulled", request_id=request.request_id, migration_id=handoff.migration_id,
                 source=handoff.source, num_blocks=response.num_blocks, num_bytes=response.num_bytes,
                 seconds=round(time.perf_counter() - started, 4))
        return request
