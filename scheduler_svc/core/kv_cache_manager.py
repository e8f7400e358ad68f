"""Block tables of sequences over one BlockPool: prefix hits, growth, copy-on-write, deferred free,
and, for a model whose every layer has a sliding window, freeing the blocks that fell out of it.

Every method is O(blocks it touches); nothing walks the whole pool per step (but check_refs: tests).
"""

from __future__ import annotations

from collections import Counter

import scheduler_svc.core.prefix_index as prefix_index
from pagoda.contract.ids import BlockId
from pagoda.contract.step import BlockCopy, StepPlan, TableUpdate
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.prefix_index import PrefixIndex
from scheduler_svc.core.request import NULL_BLOCK, SeqStatus, Sequence
from scheduler_svc.core.tiers.disk_tier import DiskTier
from scheduler_svc.core.tiers.host_tier import HostTier


def position_to_block(pos: int, block_size: int) -> tuple[int, int]:
    """Token position -> (logical block index, offset inside the block)."""
    return divmod(pos, block_size)


def slot_mapping(block_table: list[BlockId], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end): slot = block_id * block_size + offset."""
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 sliding_window: int = 0, offload_base: int = 0, num_offload_blocks: int = 0,
                 num_disk_blocks: int = 0) -> None:
        self.block_size = block_size
        self.window = sliding_window  # every layer's window is at most this; 0: no freeing
        self.index = PrefixIndex() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.index)
        # The host tier (tiers/host_tier.py): evicted cached blocks go to host slots [offload_base, ...).
        self.tier = HostTier(offload_base, num_offload_blocks) \
            if enable_prefix_caching and num_offload_blocks else None
        if self.tier is not None:
            self.pool.on_evict = self.tier.offload
        # The disk tier (tiers/disk_tier.py) under the host tier: the entries it drops go to files.
        self.disk = DiskTier(num_disk_blocks) if self.tier is not None and num_disk_blocks else None
        if self.disk is not None:
            self.tier.on_drop = self.disk.store  # type: ignore[union-attr]
        self._deferred: dict[int, list[list[BlockId]]] = {}  # step id -> block lists to free then
        self.num_deferred = 0  # blocks in those lists (an upper bound of what they will free)
        self.deferred_of: Counter[str] = Counter()  # the same, per owning tenant

    # -- prefix cache -------------------------------------------------------------------------
    def _ensure_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Extend seq.block_hashes (incrementally) to its first num_blocks full blocks."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        request = seq.request
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            # Looked up on the module each time so tests can force collisions by monkeypatching it.
            hashes.append(prefix_index.hash_block(parent, tokens[i * bs:(i + 1) * bs],
                                                  request.block_keys(i, bs)))

    def find_cached_prefix(self, seq: Sequence) -> tuple[list[BlockId], int]:
        """Verified cached full blocks of a waiting sequence, leaving >= 1 token to compute. None
        for a request still owed prompt logprobs: they need the logits of every prompt position
        (vLLM also skips the hit for such requests), nor for a pooling request: mean pooling needs the
        hidden state of every prompt position (worker_svc/pooling.py)."""
        if self.index is None or seq.request.needs_prompt_logprobs or seq.request.sampling.pooling:
            return [], 0
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        self._ensure_hashes(seq, max_blocks)
        return self.index.match(seq.block_hashes, seq.token_ids, self.block_size, None, max_blocks,
                                keys_of=seq.request.block_keys)

    def find_offloaded(self, seq: Sequence, num_hit_blocks: int) -> list[int | None]:
        """The full blocks right after seq's `num_hit_blocks` device hits (found by
        find_cached_prefix just before) that a lower tier holds, verified, leaving >= 1 token to
        compute: each a host-tier slot, or None when the block is on disk (read by its hash)."""
        tier, disk = self.tier, self.disk
        if tier is None or seq.request.needs_prompt_logprobs or seq.request.sampling.pooling:
            return []
        bs, tokens, hashes = self.block_size, seq.token_ids, seq.block_hashes
        found: list[int | None] = []
        for i in range(num_hit_blocks, (len(tokens) - 1) // bs):
            block_tokens, keys = tokens[i * bs:(i + 1) * bs], seq.request.block_keys(i, bs)
            slot = tier.lookup(hashes[i], prefix_index.pack_tokens(block_tokens), keys)
            if slot is None and (disk is None or not disk.match(hashes[i], tuple(block_tokens), keys)):
                break
            found.append(slot)
        return found

    def register_computed(self, seq: Sequence, num_computed: int) -> None:
        """Register the full blocks of positions < num_computed (their writing step has reported)."""
        if self.index is None:
            return
        full = min(num_computed, len(seq.token_ids)) // self.block_size
        if full <= seq.num_registered_blocks:
            return
        self._ensure_hashes(seq, full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, full):
            serial = self.index.register(seq.block_table[i], seq.block_hashes[i], seq.last_serial,
                                         seq.token_ids[i * bs:(i + 1) * bs],
                                         seq.request.block_keys(i, bs))
            if serial is None:  # collision: the chain cannot be extended past it
                seq.num_registered_blocks = len(seq.token_ids) + 1  # never try again
                return
            seq.last_serial = serial
            seq.num_registered_blocks = i + 1

    def register_reported(self, computed: list[tuple[Sequence, int, int]]) -> None:
        """A step reported: register what it computed, (seq, generation, num_computed) each, for the
        sequences still running in that generation (a preempted one's blocks are gone)."""
        bs = self.block_size
        for seq, generation, num_computed in computed:
            if num_computed // bs > seq.num_registered_blocks and seq.generation == generation \
                    and seq.status is SeqStatus.RUNNING:
                self.register_computed(seq, num_computed)

    # -- allocation ---------------------------------------------------------------------------
    def blocks_to_admit(self, hits: list[BlockId], end: int) -> int:
        """Blocks admission consumes: new ones for positions < end, plus evictable hits it revives."""
        revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        return cdiv(end, self.block_size) - len(hits) + revived

    def tenant_blocks_to_admit(self, tenant: str, hits: list[BlockId], end: int) -> int:
        """What admission takes out of `tenant`'s room: new blocks, plus the evictable hits it
        revives that the tenant owns (another tenant's revived hit stays that tenant's)."""
        pool = self.pool
        own = sum(1 for b in hits if pool.ref_count(b) == 0 and pool.owner(b) == tenant)
        return cdiv(end, self.block_size) - len(hits) + own

    def admit_short(self, tenant: str, hits: list[BlockId], end: int) -> str | None:
        """Why admitting these blocks fails now: "pool" (not enough blocks), "tenant" (the tenant's
        cap), or None when it fits."""
        if not self.pool.can_allocate(self.blocks_to_admit(hits, end)):
            return "pool"
        if self.tenant_blocks_to_admit(tenant, hits, end) > self.pool.tenant_room(tenant):
            return "tenant"
        return None

    def admit(self, seq: Sequence, hits: list[BlockId], last_serial: int, end: int,
              host_slots: list[int | None] | None = None, plan: StepPlan | None = None) -> None:
        """Device hits first, then fresh blocks; the first len(host_slots) of those are filled in
        `plan` from the host tier (a slot) or the disk tier (None): find_offloaded's hits."""
        n = len(hits)
        if host_slots:  # before the evictions allocate makes, which could reuse or delete them
            self.tier.reserve([s for s in host_slots if s is not None])  # type: ignore[union-attr]
            if self.disk is not None:
                self.disk.reserve(seq.block_hashes[n + i] for i, slot in enumerate(host_slots) if slot is None)
        self.pool.touch(hits)  # before allocating, so the hits cannot be evicted by it
        new = self.pool.allocate(cdiv(end, self.block_size) - len(hits), seq.request.tenant)
        assert new is not None, "admit() without a successful blocks_to_admit() check"
        seq.block_table = hits + new
        seq.num_registered_blocks = len(hits)  # the loaded blocks register when their step reports
        seq.last_serial = last_serial
        if host_slots:
            hashes = seq.block_hashes[n:n + len(host_slots)]
            from_host = [i for i, slot in enumerate(host_slots) if slot is not None]
            from_disk = [i for i, slot in enumerate(host_slots) if slot is None]
            if from_host:
                self.tier.load([hashes[i] for i in from_host], [host_slots[i] for i in from_host],  # type: ignore
                               [new[i] for i in from_host], plan)
            if from_disk:
                self.disk.load([hashes[i] for i in from_disk], [new[i] for i in from_disk], plan)  # type: ignore

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        """New blocks for positions [computed, computed+num_new): appends plus copy-on-write."""
        table, bs = seq.block_table, self.block_size
        start = seq.num_computed_tokens
        end_block = cdiv(start + num_new, bs)
        need = max(0, end_block - len(table))
        ref = self.pool.ref_count
        for i in range(start // bs, min(end_block, len(table))):
            if ref(table[i]) > 1:  # shared with another table (fork) or a deferred free
                need += 1
        return need

    def grow(self, seq: Sequence, num_new: int, plan: StepPlan) -> None:
        """Make positions [computed, computed+num_new) writable; the plan carries the changes."""
        table, bs, pool, tenant = seq.block_table, self.block_size, self.pool, seq.request.tenant
        start = seq.num_computed_tokens
        end_block = cdiv(start + num_new, bs)
        for i in range(start // bs, min(end_block, len(table))):
            src = table[i]
            if pool.ref_count(src) > 1:  # first write into a shared block: copy it
                (dst,) = pool.allocate(1, tenant)  # type: ignore[misc]  # checked by blocks_needed
                plan.block_copies.append(BlockCopy(src, dst))
                plan.table_updates.append(TableUpdate(seq.seq_id, i, [dst]))
                table[i] = dst
                pool.free([src])  # ref stays >= 1: another table (or a deferred free) holds it
        if end_block > len(table):
            new = pool.allocate(end_block - len(table), tenant)
            assert new is not None, "grow() without a successful blocks_needed() check"
            plan.table_updates.append(TableUpdate(seq.seq_id, len(table), new))
            table.extend(new)

    def share(self, blocks: list[BlockId]) -> None:
        self.pool.touch(blocks)

    # -- freeing ------------------------------------------------------------------------------
    def window_freeable(self, seq: Sequence) -> bool:
        """Whether free_out_of_window would free anything now (cheap: the per-step path asks)."""
        return seq.num_computed_tokens - self.window >= (seq.num_window_freed + 1) * self.block_size

    def free_out_of_window(self, seq: Sequence, after_step: int | None) -> None:
        """Free seq's blocks wholly before (num_computed_tokens - window): the next position it
        computes sees only positions > that - 1, and later ones see less, so no step from now on
        reads them. Their entries become NULL_BLOCK; an in-flight step may still read them, so the
        free waits for `after_step` as a preempted sequence's does.

        With prefix caching only registered blocks go (their writing step has reported): a freed
        registered block keeps its hash entry and waits on the evictable LRU, so a later request
        with the same prefix can still hit the whole chain (it is evicted like any cached block).
        """
        bs = self.block_size
        end = (seq.num_computed_tokens - self.window) // bs  # blocks [0, end) end at or before it
        if self.index is not None:
            end = min(end, seq.num_registered_blocks)
        first = seq.num_window_freed
        if end <= first:
            return
        table = seq.block_table
        freed = table[first:end]
        table[first:end] = [NULL_BLOCK] * (end - first)
        seq.num_window_freed = end
        self.release(freed, after_step)

    @staticmethod
    def held_blocks(seq: Sequence) -> list[BlockId]:
        """The blocks seq's table holds a reference on (not the window-freed NULL_BLOCK entries)."""
        return seq.block_table[seq.num_window_freed:] if seq.num_window_freed else seq.block_table
    def release(self, blocks: list[BlockId], after_step: int | None) -> None:
        """Free blocks now, or once step `after_step` (still in flight, may read them) reports."""
        if not blocks:
            return
        if after_step is None:
            self.pool.free(blocks)
        else:
            self._deferred.setdefault(after_step, []).append(blocks)
            self.num_deferred += len(blocks)
            self.deferred_of.update(self.pool.owner(b) for b in blocks)  # in use: owners fixed

    def step_reported(self, step_id: int) -> None:
        for blocks in self._deferred.pop(step_id, ()):
            self.num_deferred -= len(blocks)
            self.deferred_of.subtract(self.pool.owner(b) for b in blocks)
            self.pool.free(blocks)

    def deferred_blocks(self) -> list[BlockId]:
        return [b for lists in self._deferred.values() for blocks in lists for b in blocks]

    def release_all_deferred(self) -> None:
        for step_id in sorted(self._deferred):
            self.step_reported(step_id)

    def reset(self) -> None:
        """Worker lost: every block back, the prefix index purged."""
        self._deferred.clear()
        self.num_deferred = 0
        self.deferred_of.clear()
        self.pool.reset()
        if self.tier is not None:
            self.tier.reset()
        if self.disk is not None:
            self.disk.reset()

    def seal(self, plan: StepPlan) -> None:
        """The plan is complete: the lower tiers add the copies they owe it and free their slots."""
        if self.tier is not None:
            self.tier.seal(plan)
        if self.disk is not None:
            self.disk.seal(plan)

    def check_refs(self, held: Counter[int]) -> None:
        """Raise AssertionError unless each block's ref count is what `held` counts (tables, pins)
        plus the deferred frees (O(pool): tests)."""
        pool = self.pool
        pool.check()
        if self.tier is not None:
            self.tier.check()
        if self.disk is not None:
            self.disk.check()
        held.update(self.deferred_blocks())
        for block in range(pool.num_blocks):
            if held[block] != pool.ref_count(block):
                raise AssertionError(f"block {block}: ref count {pool.ref_count(block)} but held by "
                                     f"{held[block]} tables / deferred frees")
