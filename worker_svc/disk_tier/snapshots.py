"""Session snapshots on the worker (--kv-snapshot-dir): a session lease's blocks saved as block files,
so the session survives a worker restart or moves to another replica of the same model.

The format is live migration's (migration.py), not a new one: DIR/<snapshot name>/<block index,
8 hex>.safetensors, each a block file (block_file.py) whose `token_ids` are that block's tokens and
whose metadata carries the model fingerprint and a checksum. What differs from a migration:
- the folder is kept: a restore reads it and leaves it (a snapshot may be restored again, on
  several replicas), and a new save of the session replaces it whole (written beside, then renamed);
- no fingerprint sub-folder: a snapshot another model wrote is found, and refused by its
  fingerprint with a clear error, rather than looking absent;
- the tokens of a save come with the export (the blocks are a lease's, not a resident request's).
The scheduler names the snapshot (a digest of the tenant's salt and the session id: one tenant
never reaches another's) and asks `listing` what it holds before it restores one (Worker.ReadSnapshot).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from pagoda.contract.errors import PlanError, SessionNotFoundError, SnapshotRefusedError
from pagoda.contract.step import DiskBlock, KvExport, KvImport
from pagoda.runtime.logging import get_logger
from worker_svc.disk_tier.block_file import SUFFIX, BlockFileRefused, read_block_file, write_block_file
from worker_svc.disk_tier.migration import MigrationStore, _safe_id

log = get_logger(__name__)


class SnapshotStore(MigrationStore):
    def __init__(self, root: str | Path, fingerprint: str, block_size: int) -> None:  # noqa: D107
        self.dir = Path(root)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.block_size = block_size

    def export(self, cache: torch.Tensor, exports: Sequence[KvExport], tokens: Mapping[str, list[int]]) -> None:
        """Save each lease's blocks under its snapshot name, replacing an older save whole. A save
        that fails to write is logged and dropped (the scheduler finds it missing and says so)."""
        for export in exports:
            try:
                self._save(cache, export)
            except OSError as error:  # a full disk, a racing save: this save fails, not the step
                log.error("session_save_failed", snapshot=export.migration_id, error=str(error))
                shutil.rmtree(self.dir / f".{export.migration_id}.{os.getpid()}.tmp", ignore_errors=True)

    def _save(self, cache: torch.Tensor, export: KvExport) -> None:
        bs = self.block_size
        final = self.dir / _safe_id(export.migration_id)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for index, block in enumerate(export.block_ids):
            name = index.to_bytes(4, "big")
            write_block_file(tmp / (name.hex() + SUFFIX), cache[:, :, block].cpu(),
                             DiskBlock(name, tuple(export.token_ids[index * bs:(index + 1) * bs])), self.fingerprint)
        old = final.with_name(f".{final.name}.{os.getpid()}.old")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        log.info("session_saved", snapshot=export.migration_id, num_blocks=len(export.block_ids),
                 num_tokens=export.num_tokens)

    def place(self, cache: torch.Tensor, imports: Sequence[KvImport], payloads: Sequence[torch.Tensor]) -> None:
        for block, payload in zip([b for load in imports for b in load.block_ids], payloads, strict=True):
            cache[:, :, block].copy_(payload.to(cache.device))
        for load in imports:
            log.info("session_restored", snapshot=load.migration_id, num_blocks=len(load.block_ids))

    def listing(self, name: str, verify: bool = True) -> tuple[list[int], int, int]:
        """(token ids, blocks, bytes) of snapshot `name`; with `verify`, every file is read and
        checked (fingerprint, checksum, its index) and the tokens are returned. SessionNotFoundError
        when there is none; SnapshotRefusedError when a file must not be served."""
        try:
            folder = self.dir / _safe_id(name)
        except PlanError as error:
            raise SessionNotFoundError(str(error)) from None
        files = sorted(folder.glob("*" + SUFFIX)) if folder.is_dir() else []
        if not files:
            raise SessionNotFoundError(f"no session snapshot {name} in {self.dir}")
        num_bytes = sum(path.stat().st_size for path in files)
        tokens: list[int] = []
        for index, path in enumerate(files if verify else ()):
            try:
                if path.name != index.to_bytes(4, "big").hex() + SUFFIX:
                    raise BlockFileRefused(f"block {index} is missing")
                _, block = read_block_file(path, self.fingerprint)
                if len(block.token_ids) != self.block_size:
                    raise BlockFileRefused(f"holds {len(block.token_ids)} tokens, not a full block")
            except BlockFileRefused as error:
                raise SnapshotRefusedError(f"{path}: {error}") from error
            tokens += block.token_ids
        return tokens, len(files), num_bytes


class KvFiles:
    """The runner's one handle on both folders of block files: live migration's and the session
    snapshots'. Each export or import goes to the folder its `snapshot` flag names."""

    def __init__(self, migration: MigrationStore | None, snapshots: SnapshotStore | None) -> None:
        self.migration, self.snapshots = migration, snapshots

    def _split(self, items):
        for snapshot, store in ((False, self.migration), (True, self.snapshots)):
            part = [item for item in items if item.snapshot is snapshot]
            if part and store is None:
                flag = "--kv-snapshot-dir" if snapshot else "--kv-migrate-dir"
                raise PlanError(f"a KV export or import but this worker has no {flag}")
            if part:
                yield store, part

    def check(self, exports: Sequence[KvExport], imports: Sequence[KvImport]) -> None:
        """PlanError, before anything changed, for a folder this worker lacks or a name that is unsafe."""
        list(self._split(exports)), list(self._split(imports))
        for item in (*exports, *imports):
            _safe_id(item.migration_id)

    def export(self, cache: torch.Tensor, exports: Sequence[KvExport], tokens: Mapping[str, list[int]]) -> None:
        for store, part in self._split(exports):
            store.export(cache, part, tokens)

    def read(self, imports: Sequence[KvImport], tokens: Mapping[str, list[int]]) -> list[torch.Tensor]:
        """Payloads in the order `place` takes them (migrations first, then snapshots)."""
        return [p for store, part in self._split(imports) for p in store.read(part, tokens)]

    def place(self, cache: torch.Tensor, imports: Sequence[KvImport], payloads: Sequence[torch.Tensor]) -> None:
        at = 0
        for store, part in self._split(imports):
            n = sum(len(load.block_ids) for load in part)
            store.place(cache, part, payloads[at:at + n])
            at += n
