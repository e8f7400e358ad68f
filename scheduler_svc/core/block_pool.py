"""The physical block pool: free list, ref counts and the LRU of evictable cached blocks.

A block is in exactly one of three places (the invariant `check` asserts):
- the free list: ref 0, holds nothing worth keeping;
- the evictable LRU: ref 0, but holds a registered prefix block that a later request may hit;
- in use: ref > 0 (shared when > 1: prefix hits, forked sequences, deferred frees).
Allocation takes the free list first (FIFO, so block ids are predictable), then evicts the LRU head
(handing its prefix entry to `on_evict` first, when set: the host tier copies it, tiers/host_tier.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from pagoda.contract.ids import BlockId
from scheduler_svc.core.prefix_index import PrefixIndex


class BlockPool:
    __slots__ = ("num_blocks", "_ref", "_free", "_evictable", "_num_used", "_index",
                 "num_allocated_total", "num_freed_total", "on_evict")

    def __init__(self, num_blocks: int, index: PrefixIndex | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._index = index
        self._ref = [0] * num_blocks
        self._free: deque[BlockId] = deque(BlockId(b) for b in range(num_blocks))
        self._evictable: OrderedDict[BlockId, None] = OrderedDict()  # LRU first
        self._num_used = 0
        # Monotonic, for the blocks/s metrics: blocks that went from available (free or evictable)
        # to in use, and back. allocated - freed == num_used at all times.
        self.num_allocated_total = 0
        self.num_freed_total = 0
        # Called with (block, its prefix entry) when a cached block is evicted for reuse.
        self.on_evict: Callable[[BlockId, tuple], None] | None = None

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def ref_counts(self) -> list[int]:
        """The live ref-count list, indexed by block id (read-only use; for hot loops)."""
        return self._ref

    def ref_count(self, block: BlockId) -> int:
        return self._ref[block]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + len(self._evictable)

    def evictable_order(self) -> list[BlockId]:
        """Evictable blocks, next victim first (for tests and debugging)."""
        return list(self._evictable)

    # -- changes ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[BlockId] | None:
        """n fresh blocks with ref 1, or None (and nothing changed) when there are not enough."""
        if not self.can_allocate(n):
            return None
        out: list[BlockId] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                entry = self._index.remove(block)  # type: ignore[union-attr]  # evictable implies an index
                if self.on_evict is not None:
                    self.on_evict(block, entry)
            self._ref[block] = 1
            out.append(block)
        self._num_used += n
        self.num_allocated_total += n
        return out

    def touch(self, blocks: Iterable[BlockId]) -> None:
        """Take one more reference on blocks already holding data (prefix hits, forks)."""
        ref = self._ref
        for block in blocks:
            if ref[block] == 0:
                del self._evictable[block]
                self._num_used += 1
                self.num_allocated_total += 1
            ref[block] += 1

    def free(self, blocks: list[BlockId]) -> None:
        """Drop one reference on each block, tail first: the tail of a sequence is evicted first."""
        ref = self._ref
        index = self._index
        used_before = self._num_used
        for block in reversed(blocks):
            ref[block] -= 1
            if ref[block] == 0:
                self._num_used -= 1
                if index is not None and index.is_cached(block):
                    self._evictable[block] = None
                else:
                    self._free.append(block)
            elif ref[block] < 0:
                raise AssertionError(f"block {block} freed more often than allocated")
        self.num_freed_total += used_before - self._num_used

    def purge_cached(self) -> None:
        """Forget every cached prefix (worker restart): evictable blocks go back to the free list."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        if self._index is not None:
            self._index.purge()

    def reset(self) -> None:
        """Every block back to the free list, in id order; the prefix index is purged."""
        self.num_freed_total += self._num_used
        self._ref = [0] * self.num_blocks
        self._free = deque(BlockId(b) for b in range(self.num_blocks))
        self._evictable.clear()
        self._num_used = 0
        if self._index is not None:
            self._index.purge()

    def check(self) -> None:
        """free + evictable + in use == total, and each block sits in the right place."""
        in_use = sum(1 for r in self._ref if r > 0)
        total = len(self._free) + len(self._evictable) + in_use
        if total != self.num_blocks or in_use != self._num_used:
            raise AssertionError(f"pool accounting: free {len(self._free)} + evictable "
                                 f"{len(self._evictable)} + in use {in_use} (counter {self._num_used})"
                                 f" != {self.num_blocks}")
        if len(set(self._free)) != len(self._free) or set(self._free) & set(self._evictable):
            raise AssertionError("a block is twice on the free list or both free and evictable")
        for block in self._free:
            if self._ref[block] != 0:
                raise AssertionError(f"free block {block} has ref {self._ref[block]}")
            if self._index is not None and self._index.is_cached(block):
                raise AssertionError(f"free block {block} is still in the prefix index")
        for block in self._evictable:
            if self._ref[block] != 0 or not self._index.is_cached(block):  # type: ignore[union-attr]
                raise AssertionError(f"evictable block {block} is in use or not cached")
