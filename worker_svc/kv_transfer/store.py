"""The runner's handle on live migration over gRPC: what `MigrationStore` (the shared folder) is for
--kv-transfer dir, with the same export / read / place calls, so the runner's KvFiles dispatches to
either. Exports go to the outbox (served by FetchKv), imports come from the inbox (filled by PullKv).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pagoda.contract.step import KvExport, KvImport
from worker_svc.kv_transfer.inbox import KvInbox
from worker_svc.kv_transfer.outbox import KvOutbox

GIB = 1 << 30


class KvTransferStore:
    def __init__(self, fingerprint: str, block_size: int, address: str, buffer_bytes: int, ttl_s: float,
                 tls_ca: str | None = None) -> None:
        self.address = address  # advertised in Init: where other workers fetch this one's exports
        self.fingerprint = fingerprint
        self.tls_ca = tls_ca  # PEM CA the other workers' KvTransfer ports are verified against
        self.outbox = KvOutbox(fingerprint, block_size, buffer_bytes, ttl_s)
        self.inbox = KvInbox(fingerprint, block_size, buffer_bytes, ttl_s)

    def export(self, cache: torch.Tensor, exports: Sequence[KvExport], tokens: Mapping[str, list[int]]) -> None:
        self.outbox.export(cache, exports, tokens)

    def read(self, imports: Sequence[KvImport], tokens: Mapping[str, list[int]]) -> list[torch.Tensor]:
        return self.inbox.read(imports, tokens)

    def place(self, cache: torch.Tensor, imports: Sequence[KvImport], payloads: Sequence[torch.Tensor]) -> None:
        self.inbox.place(cache, imports, payloads)


def migration_transport(config, fingerprint: str, block_size: int):
    """The worker's live-migration store for its flags: the shared folder (--kv-transfer dir with
    --kv-migrate-dir), worker-to-worker gRPC (--kv-transfer grpc), or None (a migrated request
    recomputes on its target)."""
    from worker_svc.disk_tier.migration import MigrationStore

    if getattr(config, "kv_transfer", "dir") == "grpc":
        return KvTransferStore(fingerprint, block_size, config.kv_transfer_address,
                               int(config.kv_transfer_buffer_size * GIB), config.kv_transfer_ttl_s,
                               config.kv_transfer_tls_ca)
    return MigrationStore(config.kv_migrate_dir, fingerprint, block_size) if config.kv_migrate_dir else None
