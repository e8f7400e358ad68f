"""The disk tier's directory on the worker: block files keyed by hash, under a size cap.

The scheduler decides (scheduler_svc/core/tiers/disk_tier.py): which host slot to write to which
hash, which file to delete when full, which file to load into which device block; the plan carries
it and this store does it (a plan's loads are read and verified while the worker validates it). What the store decides alone is what is on disk at Init: it lists the
files, least recently used first (by modification time: a load touches its file), refuses every
file that does not verify (deleted, with a log line), trims the oldest beyond the cap, and the
scheduler rebuilds its index from that listing. So the tier survives a worker restart.

Files live in DIR/<first 16 hex of the model fingerprint>/<block hash hex>.safetensors: two models
sharing a directory never collide on a block's name (each file's metadata is checked anyway). One
live worker per such folder: each keeps its own index in its scheduler, so a second one deleting
files behind the first's back would make its loads fail. The store holds an exclusive lock on
`.lock` there until `close` (or the process ends); a second worker is refused at start.
Reads and writes are synchronous, inside the step (a block of SmolLM2-135M in fp32 is 720 KiB).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pagoda.contract.step import DiskBlock, DiskLoad, DiskWrite
from pagoda.runtime.logging import get_logger
from worker_svc.disk_tier.block_file import (
    FILE_OVERHEAD_BYTES,
    SUFFIX,
    BlockFileRefused,
    read_block_file,
    write_block_file,
)

log = get_logger(__name__)


def num_disk_blocks(size_gib: float, bytes_per_block: int) -> int:
    """Files the cap holds: each counts its payload plus FILE_OVERHEAD_BYTES."""
    return max(0, int(size_gib * (1 << 30)) // (bytes_per_block + FILE_OVERHEAD_BYTES))


class DiskStore:
    def __init__(self, root: str | Path, fingerprint: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the disk tier's size cap holds no block ({capacity}): raise --kv-offload-dir-size")
        self.dir = Path(root) / fingerprint[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.dir / ".lock", "a")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise ValueError(f"another worker uses the disk tier in {self.dir}: give each worker its own "
                             "--kv-offload-dir") from None
        self.fingerprint = fingerprint
        self.capacity = capacity
        self._last_touch_ns = 0

    def _touch(self, path: Path) -> None:
        """Stamp `path` most recently used. Explicit, strictly increasing times: the file system's
        own are coarse (a clock tick), and ties would lose the LRU order across a restart."""
        self._last_touch_ns = max(time.time_ns(), self._last_touch_ns + 1)
        os.utime(path, ns=(self._last_touch_ns, self._last_touch_ns))

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def listing(self) -> tuple[DiskBlock, ...]:
        """The verified files, least recently used first, at most `capacity` (the oldest beyond it
        are deleted); every refused file is deleted, and left-over temporary files too."""
        for tmp in self.dir.glob("*.tmp"):  # a write a crash interrupted
            tmp.unlink(missing_ok=True)
        files = sorted(self.dir.glob("*" + SUFFIX), key=lambda p: (p.stat().st_mtime_ns, p.name))
        blocks: list[DiskBlock] = []
        for path in files:
            try:
                blocks.append(read_block_file(path, self.fingerprint)[1])
            except BlockFileRefused as error:
                self._refuse(path, error)
        for block in blocks[:max(0, len(blocks) - self.capacity)]:
            self.path(block.block_hash).unlink(missing_ok=True)
        kept = tuple(blocks[max(0, len(blocks) - self.capacity):])
        log.info("disk_tier_listed", dir=str(self.dir), num_files=len(kept), capacity=self.capacity,
                 num_refused=len(files) - len(blocks), num_trimmed=max(0, len(blocks) - self.capacity))
        return kept

    def delete_and_write(self, host: torch.Tensor, cache: torch.Tensor, deletes: Sequence[bytes],
                         writes: Sequence[DiskWrite]) -> None:
        """`host`, `cache`: the host pool's and the device cache's raw storage [L, 2, num_blocks,
        block_size, H, D]. Runs before the plan's swap_out, which may refill the host slots written
        here, and before anything writes the device blocks written here."""
        for block_hash in deletes:
            self.path(block_hash).unlink(missing_ok=True)
        for write in writes:
            path = self.path(write.block.block_hash)
            source = cache[:, :, write.src].cpu() if write.from_device else host[:, :, write.src]
            write_block_file(path, source, write.block, self.fingerprint)
            self._touch(path)

    def read(self, loads: Sequence[DiskLoad]) -> list[torch.Tensor]:
        """The payloads of a plan's loads, verified; read while the plan is validated, so a refused
        file (BlockFileRefused, the file deleted first) rejects the plan before anything changed:
        the scheduler resyncs, its requests recompute, and the next Init's listing lacks the file."""
        payloads = []
        for load in loads:
            path = self.path(load.block_hash)
            try:
                payload, block = read_block_file(path, self.fingerprint)
                if block.block_hash != load.block_hash:
                    raise BlockFileRefused("holds another block")
            except BlockFileRefused as error:
                self._refuse(path, error)
                raise
            payloads.append(payload)
        return payloads

    def place(self, cache: torch.Tensor, loads: Sequence[DiskLoad], payloads: Sequence[torch.Tensor]) -> None:
        """`cache`: the device cache's raw storage; `payloads`: `read(loads)`."""
        for load, payload in zip(loads, payloads, strict=True):
            cache[:, :, load.dst].copy_(payload.to(cache.device))
            self._touch(self.path(load.block_hash))  # most recently used: the next Init lists it last

    def close(self) -> None:
        """Let another worker (or a new LLM in this process) use the directory."""
        self._lock_file.close()

    def _refuse(self, path: Path, error: BlockFileRefused) -> None:
        log.warning("disk_block_refused", path=str(path), reason=str(error))
        path.unlink(missing_ok=True)
