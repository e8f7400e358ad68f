"""The prefix cache's disk tier (`--kv-offload-dir`): blocks the host tier drops are written to files
keyed by their block hash, and a later prefix hit on one is read back into a device block.

The worker owns the files (worker_svc/disk_tier/); this is the scheduler's index of them, pure:
- Write, when the host tier drops an entry to reuse its slot (host_tier.py `on_drop`): the plan
  carries `DiskWrite(host slot, block)`; when it has no slot for an evicted device block (every
  slot read or written by the plan being built), `DiskWrite(device block, block, from_device)`.
  A hash already on disk costs no write (most recent now).
- Load, at admission: past a waiting sequence's device and host hits, its next full blocks whose
  hashes are here (verified: token ids and extra keys equal) are hits too; the plan carries
  `DiskLoad(hash, device block)`. The file stays (the tier is inclusive, like the host tier).
- Budget: at most `capacity` files (the worker's --kv-offload-dir-size over one file's size).
  When full, the least recently used file not read or written by the plan being built is deleted
  in the plan (`disk_deletes`); with every file busy the block is dropped, as without the tier.

Order on the worker, per plan: disk_deletes, disk_writes, swap_out, swap_in, disk_loads. A write
reads its host slot before a swap_out of the same plan refills it (the host tier reuses the slot it
dropped at once), or its evicted device block before a load or the forward rewrites it (the block
is registered, so every step that wrote it has reported, and has ref 0, so none in flight reads it); a load runs after the swap_out that saved its device block's evicted content, and
after any write of its hash in the same plan; a delete never hits a file the plan reads or writes.

A worker restart keeps the files: every Init lists the verified files on disk (least recently used
first), and `restore` rebuilds the index from that list, so the next turn after a restart hits.
`reset` (worker loss, failed step) empties the index until that Init: what a lost worker wrote or
deleted in its last steps is only known from its successor's listing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagoda.contract.ids import BlockId
from pagoda.contract.step import DiskBlock, DiskLoad, DiskWrite, StepPlan


class DiskTier:
    __slots__ = ("capacity", "_entries", "_busy", "_writes", "_deletes",
                 "blocks_written", "blocks_loaded", "blocks_dropped")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the disk tier needs at least one block, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, DiskBlock] = OrderedDict()  # least recently used first
        self._busy: set[bytes] = set()  # hashes the plan being built reads or writes
        self._writes: list[DiskWrite] = []  # owed to the plan being built
        self._deletes: list[bytes] = []
        self.blocks_written = 0  # host -> file
        self.blocks_loaded = 0  # file -> device (prefix hits served from disk)
        self.blocks_dropped = 0  # files deleted by the full tier, and blocks it had no room for

    @property
    def num_used(self) -> int:
        return len(self._entries)

    @property
    def usage(self) -> float:
        return len(self._entries) / self.capacity

    def hashes(self) -> list[bytes]:
        """The files, next victim first (tests)."""
        return list(self._entries)

    # -- host tier drop -> disk ------------------------------------------------------------------
    def store(self, src: int, block: DiskBlock, from_device: bool = False) -> None:
        """The host tier drops `block` from host slot `src` to reuse the slot in this plan, or has no
        slot for device block `src` being evicted (`from_device`: every slot busy in this plan)."""
        if block.block_hash in self._entries:  # already on disk: no write
            self._entries.move_to_end(block.block_hash)
            return
        if len(self._entries) >= self.capacity and not self._delete_lru():
            self.blocks_dropped += 1  # every file is read or written by this plan
            return
        self._entries[block.block_hash] = block
        self._busy.add(block.block_hash)
        self._writes.append(DiskWrite(src, block, from_device))
        self.blocks_written += 1

    def _delete_lru(self) -> bool:
        for block_hash in self._entries:  # LRU first
            if block_hash not in self._busy:
                del self._entries[block_hash]
                self._deletes.append(block_hash)
                self.blocks_dropped += 1
                return True
        return False

    # -- disk -> device --------------------------------------------------------------------------
    def match(self, block_hash: bytes, token_ids: tuple[int, ...], extra_keys: tuple) -> bool:
        """Whether the block is on disk, verified as the prefix index verifies a hit."""
        held = self._entries.get(block_hash)
        return held is not None and held.token_ids == token_ids and held.extra_keys == extra_keys

    def reserve(self, hashes: Iterable[bytes]) -> None:
        """Files about to be loaded: the evictions the admission's allocation makes must not delete them."""
        self._busy.update(hashes)

    def load(self, hashes: Sequence[bytes], device_blocks: Sequence[BlockId], plan: StepPlan) -> None:
        for block_hash, block in zip(hashes, device_blocks, strict=True):
            self._entries.move_to_end(block_hash)
            self._busy.add(block_hash)
            plan.disk_loads.append(DiskLoad(block_hash, block))
        self.blocks_loaded += len(hashes)

    # -- per plan, resets ------------------------------------------------------------------------
    def seal(self, plan: StepPlan) -> None:
        """The plan is complete: it carries the deletes and writes owed; its files are free again."""
        if self._deletes:
            plan.disk_deletes.extend(self._deletes)
            self._deletes = []
        if self._writes:
            plan.disk_writes.extend(self._writes)
            self._writes = []
        self._busy.clear()

    def reset(self) -> None:
        """The worker is gone: forget the index until the next Init's listing (`restore`)."""
        self._entries.clear()
        self._busy.clear()
        self._writes = []
        self._deletes = []

    def restore(self, blocks: Sequence[DiskBlock]) -> None:
        """The worker's Init listing (least recently used first) becomes the index. The worker
        trimmed it to its cap; a longer one keeps its most recent `capacity` (the rest is never
        loaded, and the worker overwrites or trims it later)."""
        self.reset()
        for block in blocks[max(0, len(blocks) - self.capacity):]:
            self._entries[block.block_hash] = block

    def check(self) -> None:
        """on disk + room == capacity; what a plan reads or writes is on disk, what it deletes is not."""
        if len(self._entries) > self.capacity:
            raise AssertionError(f"disk tier accounting: {len(self._entries)} files > {self.capacity}")
        if not self._busy <= self._entries.keys():
            raise AssertionError("a busy disk block is not in the disk tier")
        if any(w.block.block_hash not in self._entries for w in self._writes):
            raise AssertionError("a disk write owed to the plan is not in the disk tier")


def disk_tier_stats(tier: DiskTier | None) -> dict:
    """The disk tier's SchedulerStats fields."""
    if tier is None:
        return {}
    return dict(num_disk_blocks=tier.capacity, disk_kv_usage=tier.usage, blocks_disk_written=tier.blocks_written,
                blocks_disk_loaded=tier.blocks_loaded, blocks_disk_dropped=tier.blocks_dropped)
