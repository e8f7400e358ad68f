"""The physical block pool: free list, ref counts and the LRU of evictable cached blocks.

A block is in exactly one of three places (the invariant `check` asserts):
- the free list: ref 0, holds nothing worth keeping;
- the evictable LRU: ref 0, but holds a registered prefix block that a later request may hit;
- in use: ref > 0 (shared when > 1: prefix hits, forked sequences, deferred frees).
Allocation takes the free list first (FIFO, so block ids are predictable), then evicts the LRU head
(handing its prefix entry to `on_evict` first, when set: the host tier copies it, tiers/host_tier.py).

Tenants (docs/kv_tiers.md#per-tenant-kv-budgets): every block in use or evictable has one owner,
the tenant whose allocation filled it (a prefix hit by another tenant sharing its salt does not
move it), so the tenants' held counts sum to used + evictable. A tenant holds at most its cap
(`set_cap`: its own, else the default): its in-use blocks may not exceed it, and once its held count reaches
it, each further block recycles the tenant's own least recently used cached block instead of
taking a free one or another tenant's. Under its cap a tenant allocates in the pool's usual order.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable

from pagoda.contract.ids import BlockId
from scheduler_svc.core.prefix_index import PrefixIndex


class BlockPool:
    __slots__ = ("num_blocks", "_ref", "_free", "_evictable", "_num_used", "_index",
                 "num_allocated_total", "num_freed_total", "on_evict", "_owner", "held",
                 "_evictable_of", "_num_evictable_of", "caps", "default_cap", "_capped")

    def __init__(self, num_blocks: int, index: PrefixIndex | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._index = index
        if index is not None:
            index.reserve(num_blocks)
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
        self._owner: list[str | None] = [None] * num_blocks  # None: on the free list
        self.held: Counter[str] = Counter()  # tenant -> blocks it owns (in use + evictable)
        # tenant -> its part of the LRU, kept only while some tenant has a cap (`_capped`): only
        # a capped tenant recycles its own oldest block, and without caps it would be a second
        # ordered dict entry for every cached block (memory that grows as the index fills).
        self._evictable_of: dict[str, OrderedDict[BlockId, None]] = {}
        self._num_evictable_of: Counter[str] = Counter()  # tenant -> its evictable blocks
        self.caps: dict[str, int] = {}  # tenant -> blocks it may hold; else default_cap
        self.default_cap = num_blocks  # = no cap
        self._capped = False  # some cap is below the pool (else the per-block checks are skipped)

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

    def can_allocate(self, n: int, tenant: str | None = None) -> bool:
        """Whether n blocks are available, and (given a tenant) within that tenant's cap."""
        return n <= len(self._free) + len(self._evictable) and \
            (tenant is None or not self._capped or n <= self.tenant_room(tenant))

    # -- tenants ------------------------------------------------------------------------------
    def set_cap(self, tenant: str | None, cap: int) -> None:
        """`tenant`'s cap (None: the default for tenants without their own)."""
        if tenant is None:
            self.default_cap = cap
        else:
            self.caps[tenant] = cap
        capped = self.default_cap < self.num_blocks or any(c < self.num_blocks for c in self.caps.values())
        if capped and not self._capped:  # the tenants' LRU parts: the global order, split by owner
            for block in self._evictable:
                self._evictable_of.setdefault(self._owner[block], OrderedDict())[block] = None  # type: ignore[index]
        elif not capped:
            self._evictable_of.clear()
        self._capped = capped

    def cap_of(self, tenant: str) -> int:
        return self.caps.get(tenant, self.default_cap)

    def owner(self, block: BlockId) -> str | None:
        return self._owner[block]

    def num_evictable_of(self, tenant: str) -> int:
        return self._num_evictable_of[tenant]

    def tenant_room(self, tenant: str) -> int:
        """Blocks `tenant` may still take into use: its cap less its in-use blocks (its cached ones
        it recycles once at the cap). Never negative: in-use <= held <= cap."""
        return self.cap_of(tenant) - self.held[tenant] + self.num_evictable_of(tenant)

    def evictable_order(self) -> list[BlockId]:
        """Evictable blocks, next victim first (for tests and debugging)."""
        return list(self._evictable)

    # -- changes ------------------------------------------------------------------------------
    def allocate(self, n: int, tenant: str = "") -> list[BlockId] | None:
        """n fresh blocks with ref 1 owned by `tenant`, or None (and nothing changed) when there are
        not enough or they would take the tenant past its cap."""
        if not self.can_allocate(n, tenant):
            return None
        out: list[BlockId] = []
        held, owner, cap = self.held, self._owner, self.cap_of(tenant)
        for _ in range(n):
            if self._capped and held[tenant] >= cap:  # at its cap: recycle its own oldest cached block
                block, _ = self._evictable_of[tenant].popitem(last=False)
                del self._evictable[block]
                self._num_evictable_of[tenant] -= 1
                self._evict(block)
            elif self._free:
                block = self._free.popleft()
                held[tenant] += 1
            else:
                block, _ = self._evictable.popitem(last=False)
                previous = owner[block]
                if self._capped:
                    del self._evictable_of[previous][block]  # type: ignore[index]
                self._num_evictable_of[previous] -= 1  # type: ignore[index]
                held[previous] -= 1  # type: ignore[index]
                held[tenant] += 1
                self._evict(block)
            owner[block] = tenant
            self._ref[block] = 1
            out.append(block)
        self._num_used += n
        self.num_allocated_total += n
        return out

    def _evict(self, block: BlockId) -> None:
        entry = self._index.remove(block)  # type: ignore[union-attr]  # evictable implies an index
        if self.on_evict is not None:
            self.on_evict(block, entry)

    def touch(self, blocks: Iterable[BlockId]) -> None:
        """Take one more reference on blocks already holding data (prefix hits, forks)."""
        ref = self._ref
        for block in blocks:
            if ref[block] == 0:
                del self._evictable[block]
                owner = self._owner[block]
                if self._capped:
                    del self._evictable_of[owner][block]  # type: ignore[index]
                self._num_evictable_of[owner] -= 1  # type: ignore[index]
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
                owner = self._owner[block]
                if index is not None and index.is_cached(block):
                    self._evictable[block] = None
                    self._num_evictable_of[owner] += 1  # type: ignore[index]
                    if self._capped:
                        lru = self._evictable_of.get(owner)  # type: ignore[arg-type]
                        if lru is None:
                            lru = self._evictable_of[owner] = OrderedDict()  # type: ignore[index]
                        lru[block] = None
                else:
                    self._free.append(block)
                    self.held[owner] -= 1  # type: ignore[index]
                    self._owner[block] = None
            elif ref[block] < 0:
                raise AssertionError(f"block {block} freed more often than allocated")
        self.num_freed_total += used_before - self._num_used

    def purge_cached(self) -> None:
        """Forget every cached prefix (worker restart): evictable blocks go back to the free list."""
        self._free.extend(self._evictable)
        for block in self._evictable:
            self.held[self._owner[block]] -= 1  # type: ignore[index]
            self._owner[block] = None
        self._evictable.clear()
        self._evictable_of.clear()
        self._num_evictable_of.clear()
        if self._index is not None:
            self._index.purge()

    def reset(self) -> None:
        """Every block back to the free list, in id order; the prefix index is purged."""
        self.num_freed_total += self._num_used
        self._ref = [0] * self.num_blocks
        self._free = deque(BlockId(b) for b in range(self.num_blocks))
        self._evictable.clear()
        self._evictable_of.clear()
        self._num_evictable_of.clear()
        self._owner = [None] * self.num_blocks
        self.held.clear()
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
        self._check_tenants()

    def _check_tenants(self) -> None:
        """Each tenant owns what its counters say, at most its cap; the counts sum to used + cached."""
        owned = Counter(o for o in self._owner if o is not None)
        if +owned != +self.held or sum(owned.values()) != self._num_used + len(self._evictable):
            raise AssertionError(f"tenant blocks {dict(owned)} (counters {dict(+self.held)}) vs used "
                                 f"{self._num_used} + evictable {len(self._evictable)}")
        for tenant, n in owned.items():
            if n > self.cap_of(tenant):
                raise AssertionError(f"tenant {tenant!r} holds {n} blocks, over its cap {self.cap_of(tenant)}")
        for block in self._free:
            if self._owner[block] is not None:
                raise AssertionError(f"free block {block} is owned by {self._owner[block]!r}")
        if +Counter(self._owner[b] for b in self._evictable) != +self._num_evictable_of:
            raise AssertionError(f"evictable blocks per tenant {dict(+self._num_evictable_of)} are not "
                                 "what the owners say")
        if not self._capped:
            if self._evictable_of:
                raise AssertionError("tenants' LRU parts kept without a cap")
            return
        split: dict[str, list[BlockId]] = {}
        for block in self._evictable:  # each tenant's part: the global order restricted to it
            split.setdefault(self._owner[block], []).append(block)  # type: ignore[arg-type]
        if split != {t: list(lru) for t, lru in self._evictable_of.items() if lru}:
            raise AssertionError("the tenants' LRU parts do not partition the evictable blocks in order")
