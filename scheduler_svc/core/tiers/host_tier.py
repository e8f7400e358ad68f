"""The prefix cache's host tier (`--kv-offloading-size`): cached blocks evicted from the device pool
are copied to host memory instead of dropped, and a later prefix hit on them is copied back.

- Offload, at eviction: when BlockPool.allocate takes a cached evictable block (ref 0, registered)
  for reuse, its hash entry moves here with a host slot, and the plan carries the copy
  (`StepPlan.swap_out`, device block -> host slot). A hash already here costs no copy (the tier
  is inclusive: a block loaded back keeps its host copy, so evicting it again is free).
- Load, at admission: past a waiting sequence's device hits, its next full blocks whose hashes are
  here (or, with the disk tier, on disk: disk_tier.py) are hits too; the plan copies them into the device blocks allocated for them
  (`StepPlan.swap_in`, host slot -> device block), and they count as cached tokens. Their device
  blocks are registered in the prefix index when the step reports, as computed blocks are.
- Host slots are the worker's host pool ids after the swap space's, [base, base + capacity). When
  the tier is full the least recently used entry is dropped (never one the plan being built
  reads or writes: the worker runs a plan's device -> host copies before its host -> device ones,
  so a slot reused by an offload would be overwritten before a load in the same plan read it).
  With the disk tier, the dropped entry is written to a file first (`on_drop`, disk_tier.py).

Why the copies are safe, pipelining included (the worker runs plans in order, each plan's swap_out
before its swap_in, block copies and forward): an evicted block is registered, so every step that
wrote it has reported; it has ref 0, so no in-flight step reads it; the offload runs before
anything in its plan writes the block's new owner. A load in the same plan as the offload that
filled its slot runs after it. A worker loss takes the host pool with it: `reset` empties the tier.

A hit is verified like a device one: the entry keeps the block's token ids and extra keys, and a
match needs both equal besides the chained hash (SHA-256 over the parent's hash, so equal hashes
with equal tokens and keys mean an equal parent chain unless SHA-256 collides). The Scheduler's
KVCacheManager holds one HostTier and hands its pool's evictions to it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from pagoda.contract.ids import BlockId
from pagoda.contract.step import BlockCopy, DiskBlock, StepPlan
from scheduler_svc.core.prefix_index import unpack_tokens

# What the prefix index held for a block: (hash, parent serial, packed token ids, extra keys, serial).
_HASH, _TOKENS, _KEYS = 0, 2, 3


class HostTier:
    __slots__ = ("base", "capacity", "_free", "_entries", "_busy", "_offloads",
                 "blocks_offloaded", "blocks_loaded", "blocks_dropped", "on_drop")

    def __init__(self, base: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the host tier needs at least one block, got {capacity}")
        self.base = base  # host ids [base, base + capacity) are the tier's (the swap pool's come first)
        self.capacity = capacity
        self._free: deque[int] = deque(range(base, base + capacity))
        # hash -> (host slot, packed token ids as the prefix index keeps them, extra keys), least
        # recently used first
        self._entries: OrderedDict[bytes, tuple[int, bytes, tuple]] = OrderedDict()
        self._busy: set[int] = set()  # slots the plan being built reads or writes
        self._offloads: list[BlockCopy] = []  # device -> host copies owed to the plan being built
        self.blocks_offloaded = 0  # device -> host copies
        self.blocks_loaded = 0  # host -> device copies (prefix hits served from the host)
        self.blocks_dropped = 0  # entries the tier itself evicted (full)
        # Called with (slot, block, False) when a full tier drops an entry to reuse its slot in the
        # plan being built, and with (device block, block, True) for an evicted block it has no
        # slot for: the disk tier (disk_tier.py) writes either to a file first.
        self.on_drop: Callable[[int, DiskBlock, bool], None] | None = None

    @property
    def num_used(self) -> int:
        return len(self._entries)

    @property
    def usage(self) -> float:
        return len(self._entries) / self.capacity

    def lru_slots(self) -> list[int]:
        """Host slots of the entries, next victim first (tests)."""
        return [slot for slot, _, _ in self._entries.values()]

    # -- device eviction -> host --------------------------------------------------------------
    def offload(self, block: BlockId, entry: tuple) -> None:
        """`block`, holding the prefix entry `entry`, is being evicted from the device pool."""
        block_hash = entry[_HASH]
        held = self._entries.get(block_hash)
        if held is not None:  # its content is already here (loaded back earlier): no copy
            self._entries.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:  # every slot is read or written by this plan: drop it, as without a tier,
            if self.on_drop is not None:  # or write the device block straight to disk
                self.on_drop(block, DiskBlock(block_hash, unpack_tokens(entry[_TOKENS]), entry[_KEYS]), True)
            return
        self._entries[block_hash] = (slot, entry[_TOKENS], entry[_KEYS])
        self._busy.add(slot)
        self._offloads.append(BlockCopy(block, slot))
        self.blocks_offloaded += 1

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for block_hash, (slot, tokens, keys) in self._entries.items():  # LRU first
            if slot not in self._busy:
                del self._entries[block_hash]
                self.blocks_dropped += 1
                if self.on_drop is not None:
                    self.on_drop(slot, DiskBlock(block_hash, unpack_tokens(tokens), keys), False)
                return slot
        return None

    # -- host -> device ------------------------------------------------------------------------
    def lookup(self, block_hash: bytes, token_ids: bytes, extra_keys: tuple) -> int | None:
        """The host slot holding the block, verified (token ids, packed by prefix_index.pack_tokens,
        and extra keys equal), or None."""
        held = self._entries.get(block_hash)
        if held is None or held[1] != token_ids or held[2] != extra_keys:
            return None
        return held[0]

    def reserve(self, slots: list[int]) -> None:
        """Slots about to be loaded: the evictions the admission's allocation makes must not reuse them."""
        self._busy.update(slots)

    def load(self, block_hashes: Sequence[bytes], slots: list[int], device_blocks: list[BlockId],
             plan: StepPlan) -> None:
        """Copy host `slots` into `device_blocks` in `plan`; they stay here too (most recent)."""
        for block_hash, slot, block in zip(block_hashes, slots, device_blocks, strict=True):
            self._entries.move_to_end(block_hash)
            self._busy.add(slot)
            plan.swap_in.append(BlockCopy(slot, block))
        self.blocks_loaded += len(slots)

    # -- per plan, and resets ------------------------------------------------------------------
    def seal(self, plan: StepPlan) -> None:
        """The plan is complete: it carries the offloads owed, and its slots may be reused after it."""
        if self._offloads:
            plan.swap_out.extend(self._offloads)
            self._offloads = []
        self._busy.clear()

    def reset(self) -> None:
        """The worker's host pool is gone (worker loss, failed step): forget every entry."""
        self._free = deque(range(self.base, self.base + self.capacity))
        self._entries.clear()
        self._busy.clear()
        self._offloads = []

    def check(self) -> None:
        """free + offloaded == capacity; every slot in exactly one place, within the tier's ids."""
        slots = [slot for slot, _, _ in self._entries.values()]
        every = set(slots) | set(self._free)
        if len(slots) + len(self._free) != self.capacity or len(every) != self.capacity \
                or every != set(range(self.base, self.base + self.capacity)):
            raise AssertionError(f"host tier accounting: {len(self._free)} free + {len(slots)} offloaded "
                                 f"!= {self.capacity} slots from {self.base}")
        if not self._busy <= every:
            raise AssertionError(f"busy host slots {sorted(self._busy - every)} are not the tier's")


def tier_stats(tier: HostTier | None) -> dict:
    """The tier's SchedulerStats fields."""
    if tier is None:
        return {}
    return dict(num_offload_blocks=tier.capacity, offload_kv_usage=tier.usage,
                blocks_offloaded=tier.blocks_offloaded, blocks_loaded=tier.blocks_loaded,
                blocks_offload_dropped=tier.blocks_dropped)
