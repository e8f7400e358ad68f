"""The target side of live migration over gRPC: a continuation's KV fetched from the source worker's
FetchKv into host memory *before* the plan that loads it (KvTransfer.PullKv, which the target's
scheduler awaits before it admits the request), then checked and copied into device blocks in that
plan exactly as the shared folder's files are (migration.py: the block's tokens against the new
request's).

Why before, and not in the step: the step thread never waits on the network. A pull runs on a
helper thread with a deadline; a source that is gone, an export that is unknown or expired, a block
that is refused, or the deadline fails the pull, and the scheduler drops the import (the
continuation recomputes, as a failover one does) rather than admitting a request whose blocks would
be missing. Verification at the pull: every block file's fingerprint and checksum, its index, and the
count (wire.Assembler); at the load: its tokens.

Bounded: staged bytes never pass `capacity` (a pull that does not fit is refused), and a staged
export nobody loaded within `ttl_s` (its request aborted before admission) is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch

from pagoda.contract.errors import PlanError
from pagoda.contract.step import KvImport
from pagoda.runtime.logging import get_logger
from worker_svc.disk_tier.block_file import BlockFileRefused, read_block_bytes
from worker_svc.disk_tier.migration import checked_payloads, copy_into_blocks
from worker_svc.kv_transfer.wire import Assembler, TransferRefused

log = get_logger(__name__)


class PullFailed(Exception):
    """A pull that staged nothing; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Staged:
    blocks: list[tuple[torch.Tensor, tuple[int, ...]]]  # (payload, its token ids) per block index
    nbytes: int
    expires_at: float


class KvInbox:
    def __init__(self, fingerprint: str, block_size: int, capacity_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fingerprint, self.block_size = fingerprint, block_size
        self.capacity_bytes, self.ttl_s, self._clock = capacity_bytes, ttl_s, clock
        self._staged: dict[str, _Staged] = {}
        self._reserved = 0  # bytes of pulls under way
        self._lock = threading.Lock()

    def pull(self, source: str, migration_id: str, num_blocks: int, timeout_s: float,
             fetch: Callable[[str, str, float], Iterable]) -> tuple[int, int]:
        """Fetch, verify and stage an export (blocking: run it on a helper thread). `fetch(source,
        migration_id, timeout_s)` opens the source's FetchKv stream (service.py); returns (blocks,
        bytes); PullFailed when nothing was staged."""
        deadline = time.monotonic() + timeout_s
        assembler = Assembler(num_blocks)
        blocks: list[tuple[torch.Tensor, tuple[int, ...]]] = []
        reserved = 0
        stream = fetch(source, migration_id, timeout_s)
        try:
            for chunk in stream:
                received = [self._verified(data, len(blocks) + k) for k, data in enumerate(assembler.feed(chunk))]
                grow = sum(payload.numel() * payload.element_size() for payload, _ in received)
                self._reserve(grow, migration_id)
                reserved += grow
                blocks += received
            assembler.finish()
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= deadline:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            raise self._failed(reserved, code, f"fetching KV {migration_id} from {source}: {details}") from None
        except (TransferRefused, BlockFileRefused) as error:
            raise self._failed(reserved, grpc.StatusCode.DATA_LOSS,
                               f"KV {migration_id} from {source} refused: {error}") from None
        except PullFailed as error:
            raise self._failed(reserved, error.code, str(error)) from None
        finally:
            getattr(stream, "close", lambda: None)()  # a refused stream: cancel the call, close the channel
        with self._lock:
            self._reserved -= reserved
            self._staged[migration_id] = _Staged(blocks, reserved, self._clock() + self.ttl_s)
        return len(blocks), assembler.num_bytes

    def _verified(self, data: bytes, index: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        payload, block = read_block_bytes(data, self.fingerprint)  # fingerprint, checksum
        if block.block_hash != index.to_bytes(4, "big"):
            raise TransferRefused(f"block {index} holds block {int.from_bytes(block.block_hash, 'big')}")
        return payload, block.token_ids

    def _reserve(self, nbytes: int, migration_id: str) -> None:
        with self._lock:
            self._expire()
            used = self._reserved + sum(s.nbytes for s in self._staged.values())
            if used + nbytes > self.capacity_bytes:
                raise PullFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"KV {migration_id}: staging memory full ({used} of {self.capacity_bytes} bytes)")
            self._reserved += nbytes

    def _failed(self, reserved: int, code: grpc.StatusCode, message: str) -> PullFailed:
        with self._lock:
            self._reserved -= reserved
        return PullFailed(code, message)

    def holds(self, migration_id: str) -> bool:
        with self._lock:
            return migration_id in self._staged

    def read(self, imports: Sequence[KvImport], tokens: Mapping[str, list[int]]) -> list[torch.Tensor]:
        """The payloads of a plan's imports, their tokens checked against the new requests' (as
        MigrationStore.read); PlanError, before anything changed, when one is missing or differs."""
        with self._lock:
            staged = {load.migration_id: self._staged.get(load.migration_id) for load in imports}

        def staged_block(load: KvImport, index: int) -> tuple[torch.Tensor, Sequence[int]]:
            held = staged[load.migration_id]
            if held is None or index >= len(held.blocks):
                raise PlanError(f"migrated KV {load.migration_id} block {index} was not pulled here")
            return held.blocks[index]

        return checked_payloads(imports, tokens, self.block_size, staged_block)

    def place(self, cache: torch.Tensor, imports: Sequence[KvImport], payloads: Sequence[torch.Tensor]) -> None:
        copy_into_blocks(cache, imports, payloads)
        with self._lock:
            for load in imports:  # loaded: nobody needs it again
                self._staged.pop(load.migration_id, None)
        for load in imports:
            log.info("kv_imported", request_id=load.request_id, migration_id=load.migration_id,
                     num_blocks=len(load.block_ids), transport="grpc")

    def _expire(self) -> None:
        now = self._clock()
        for migration_id in [m for m, s in self._staged.items() if s.expires_at <= now]:
            del self._staged[migration_id]
            log.warning("kv_import_dropped", migration_id=migration_id, reason="expired")
