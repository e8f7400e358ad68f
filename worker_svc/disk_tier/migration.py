"""Live migration's files on the worker: a migrated request's KV blocks in a directory that the
source replica's worker writes and the target's reads (--kv-migrate-dir, shared by the replicas).

Why a shared directory rather than bytes through the services: only ids and counts cross the
scheduler and the gateway (a 2,000-token SmolLM2 context is 125 blocks of 720 KiB, 90 MB that would
otherwise pass four gRPC hops and be staged twice), the worker reads and writes the files as the disk
tier does, in the step, and the block file (block_file.py) already proves what it holds: model
fingerprint (another model's, dtype's or block size's KV is refused) and a checksum.
The cost: the replicas' workers must see one file system (one host, or a shared volume).

Layout: DIR/<first 16 hex of the model fingerprint>/<migration id>/<block index, 8 digits>.safetensors.
A file's `block_hash` is its index (4 bytes), its `token_ids` the tokens of that block, which the
target verifies against the continuation it serves. The target deletes the folder once it read it;
a folder nobody imported (the request finished on the source after all, or the gateway died) is
deleted by the next export that finds it older than STALE_SECONDS.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from pagoda.contract.errors import PlanError
from pagoda.contract.step import DiskBlock, KvExport, KvImport
from pagoda.runtime.logging import get_logger
from worker_svc.disk_tier.block_file import SUFFIX, BlockFileRefused, read_block_file, write_block_file

log = get_logger(__name__)

STALE_SECONDS = 600.0  # an export folder nobody imported this long after it was written is dropped


def checked_payloads(imports: Sequence[KvImport], tokens: Mapping[str, list[int]], block_size: int,
                     fetch: Callable[[KvImport, int], tuple[torch.Tensor, Sequence[int]]]) -> list[torch.Tensor]:
    """Every import's block payloads in plan order, each block's tokens checked against the new
    request's, whatever transport staged them (`fetch(load, index)` -> (payload, the block's token
    ids), raising PlanError for a block it does not hold). PlanError before anything changed."""
    payloads = []
    for load in imports:
        ids = tokens[load.request_id][:load.num_tokens]
        for k in range(len(load.block_ids)):
            index = load.first_block + k
            payload, block_tokens = fetch(load, index)
            if list(block_tokens) != ids[index * block_size:(index + 1) * block_size]:
                raise PlanError(f"migrated KV {load.migration_id} block {index} holds other tokens "
                                f"than {load.request_id!r}")
            payloads.append(payload)
    return payloads


def copy_into_blocks(cache: torch.Tensor, imports: Sequence[KvImport], payloads: Sequence[torch.Tensor]) -> None:
    """The verified payloads into the device blocks the plan gave each import, in plan order."""
    blocks = [block for load in imports for block in load.block_ids]
    for block, payload in zip(blocks, payloads, strict=True):
        cache[:, :, block].copy_(payload.to(cache.device))


def _safe_id(migration_id: str) -> str:
    """Migration ids come from the scheduler (uuid hex): refuse anything that could leave the folder."""
    if not migration_id or not migration_id.replace("-", "").isalnum():
        raise PlanError(f"bad migration id {migration_id!r}")
    return migration_id


class MigrationStore:
    def __init__(self, root: str | Path, fingerprint: str, block_size: int) -> None:
        self.dir = Path(root) / fingerprint[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.block_size = block_size

    def _path(self, migration_id: str, index: int) -> Path:
        return self.dir / _safe_id(migration_id) / (index.to_bytes(4, "big").hex() + SUFFIX)

    def export(self, cache: torch.Tensor, exports: Sequence[KvExport], tokens: Mapping[str, list[int]]) -> None:
        """`cache`: the device cache's raw storage [L, 2, num_blocks, block_size, H, D]; `tokens`:
        each exported request's token ids (its resident state). Written to a temporary folder and
        renamed, so a reader never sees half an export."""
        bs = self.block_size
        for export in exports:
            final = self.dir / _safe_id(export.migration_id)
            tmp = final.with_name(final.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            ids = tokens[export.request_id][:export.num_tokens]
            for index, block in enumerate(export.block_ids):
                block_tokens = tuple(ids[index * bs:(index + 1) * bs])
                name = index.to_bytes(4, "big")
                write_block_file(tmp / (name.hex() + SUFFIX), cache[:, :, block].cpu(),
                                 DiskBlock(name, block_tokens), self.fingerprint)
            tmp.rename(final)
            log.info("kv_exported", request_id=export.request_id, migration_id=export.migration_id,
                     num_blocks=len(export.block_ids), num_tokens=export.num_tokens)
        self._drop_stale()

    def read(self, imports: Sequence[KvImport], tokens: Mapping[str, list[int]]) -> list[torch.Tensor]:
        """The payloads of a plan's imports, verified (fingerprint, checksum, and the block's tokens
        against the new request's); PlanError, before anything changed, when one is refused."""
        def block_file(load: KvImport, index: int) -> tuple[torch.Tensor, Sequence[int]]:
            path = self._path(load.migration_id, index)
            try:
                payload, block = read_block_file(path, self.fingerprint)
            except BlockFileRefused as error:
                raise PlanError(f"migrated block {path} refused: {error}") from error
            return payload, block.token_ids

        return checked_payloads(imports, tokens, self.block_size, block_file)

    def place(self, cache: torch.Tensor, imports: Sequence[KvImport], payloads: Sequence[torch.Tensor]) -> None:
        copy_into_blocks(cache, imports, payloads)
        for load in imports:  # read: nobody needs the folder again
            shutil.rmtree(self.dir / _safe_id(load.migration_id), ignore_errors=True)
            log.info("kv_imported", request_id=load.request_id, migration_id=load.migration_id,
                     num_blocks=len(load.block_ids))

    def _drop_stale(self) -> None:
        cutoff = time.time() - STALE_SECONDS
        for folder in self.dir.iterdir():
            if folder.is_dir() and folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)
                log.warning("kv_export_dropped", migration_id=folder.name, reason="stale")
