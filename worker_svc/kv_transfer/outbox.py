"""The source side of live migration over gRPC: exported blocks kept in host memory until the
target's worker fetches them (KvTransfer.FetchKv), instead of files in a shared folder.

Bounded both ways: an export older than `ttl_s` is dropped (the request finished on the source
after all, the gateway died, the target never came), and the held bytes never pass `capacity`: an
export that does not fit is not kept (logged), so its target's fetch finds nothing and recomputes.
A completed fetch drops the export (one target imports a migration, as with the folder).

Threads: `export` runs in the step (the runner's thread); `open` and the block iterator run on the
servicer's (the event loop, or a helper thread for the serialisation): a lock guards the table.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from pagoda.contract.step import DiskBlock, KvExport
from pagoda.runtime.logging import get_logger
from worker_svc.disk_tier.block_file import block_bytes

log = get_logger(__name__)


class ExportNotFound(KeyError):
    """No export under this id: never made here, expired, dropped for room, or fetched already."""


class ForeignFingerprint(ValueError):
    """The fetching worker serves another model, dtype or cache layout."""


@dataclass(slots=True)
class _Export:
    payload: torch.Tensor  # [L, 2, num_blocks, block_size, H, D], the cache's raw view, on the host
    token_ids: list[int]  # the first num_tokens tokens: block i holds [i * bs, (i + 1) * bs)
    expires_at: float

    @property
    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size()


class KvOutbox:
    def __init__(self, fingerprint: str, block_size: int, capacity_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fingerprint, self.block_size = fingerprint, block_size
        self.capacity_bytes, self.ttl_s, self._clock = capacity_bytes, ttl_s, clock
        self._exports: dict[str, _Export] = {}
        self._lock = threading.Lock()
        self.num_dropped = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._exports.values())

    def export(self, cache: torch.Tensor, exports: Sequence[KvExport], tokens: Mapping[str, list[int]]) -> None:
        """`cache`: the device cache's raw storage [L, 2, num_blocks, block_size, H, D]. The blocks
        are copied to the host now (this plan's later operations may reuse them)."""
        for export in exports:
            index = torch.tensor(export.block_ids, dtype=torch.long, device=cache.device)
            payload = cache.index_select(2, index).cpu()  # a copy on every device (index_select copies)
            held = _Export(payload, list(tokens[export.request_id][:export.num_tokens]), self._clock() + self.ttl_s)
            with self._lock:
                self._expire()
                used = sum(e.nbytes for e in self._exports.values())
                if used + held.nbytes > self.capacity_bytes:
                    self.num_dropped += 1
                    log.warning("kv_export_dropped", migration_id=export.migration_id, reason="capacity",
                                num_bytes=held.nbytes, held_bytes=used, capacity_bytes=self.capacity_bytes)
                    continue
                self._exports[export.migration_id] = held
            log.info("kv_exported", request_id=export.request_id, migration_id=export.migration_id,
                     num_blocks=len(export.block_ids), num_tokens=export.num_tokens, transport="grpc")

    def open(self, migration_id: str, fingerprint: str) -> tuple[int, Iterator[bytes]]:
        """(block count, the blocks' bytes one at a time, serialised as they are asked for)."""
        if fingerprint != self.fingerprint:
            raise ForeignFingerprint("the fetching worker serves another model (fingerprint differs)")
        with self._lock:
            self._expire()
            held = self._exports.get(migration_id)
        if held is None:
            raise ExportNotFound(f"no KV export {migration_id!r} here (unknown, expired, or fetched)")
        return held.payload.shape[2], self._blocks(held)

    def _blocks(self, held: _Export) -> Iterator[bytes]:
        bs = self.block_size
        for index in range(held.payload.shape[2]):
            block = DiskBlock(index.to_bytes(4, "big"), tuple(held.token_ids[index * bs:(index + 1) * bs]))
            yield block_bytes(held.payload[:, :, index], block, self.fingerprint)

    def done(self, migration_id: str) -> None:
        """Fetched whole: nobody needs it again."""
        with self._lock:
            self._exports.pop(migration_id, None)

    def _expire(self) -> None:
        now = self._clock()
        for migration_id in [m for m, e in self._exports.items() if e.expires_at <= now]:
            del self._exports[migration_id]
            self.num_dropped += 1
            log.warning("kv_export_dropped", migration_id=migration_id, reason="expired")
