"""Swap preemption: a preempted sequence's KV goes to the worker's host block pool, and comes back
when it resumes, instead of being recomputed (vLLM v0's `--preemption-mode swap`).

- Swap-out, at preemption: the device blocks holding its computed tokens are copied into fresh
  host blocks (`StepPlan.swap_out`, device -> host); its device blocks are then released exactly as
  for a recompute preemption and the worker drops it (`preempted_ids`). It waits at the front of
  the waiting queue with `host_blocks` and `num_swapped_tokens`.
- Swap-in, at resumption: it is re-sent as a NewRequestData whose num_computed_tokens is its
  swapped tokens (or its prefix-cache hit, if that is longer), over device blocks allocated as for
  any admission. The blocks no prefix hit serves are filled from the host (`StepPlan.swap_in`) and
  its host blocks are freed. The worker keeps no state for a swapped request.

Why the order is safe, pipelining included (the worker runs plans in order, each plan's swap_out,
then swap_in, then block copies, then the forward):
- A swap-out in plan N+1 reads what every earlier step wrote, the in-flight step N included, so
  `num_computed_tokens` (which counts N's tokens) is exactly the KV that is saved. The tokens N
  samples arrive as for any preempted sequence, and it resumes only once they have.
- Its device blocks take the usual deferred release; a block reused in the same plan (nothing in
  flight) is written by that plan's swap-in, copies or forward, all after the swap-out read it.
- A host block is freed when its owner is swapped in or ends. Only the owner's swap-in reads it,
  and a later swap-out into it runs after that swap-in: in a later plan, or later in the same
  plan (swap_out precedes swap_in, and a plan swaps in only after its preemptions).

The choice (`preemption_mode`): "recompute" never swaps; "swap" swaps whenever the host pool has
room; None (auto) swaps a sequence whose computed tokens exceed one prefill chunk
(`long_prefill_token_threshold`), whose recomputation would take more than one step's prefill,
while the swap costs one copy of its blocks each way. What the host pool cannot hold is recomputed.
A worker loss or a failed step loses the host pool with the device cache: swapped sequences recompute.

The Scheduler holds one SwapManager: it owns the host pool, the swapped sequences and the swap
counters; the scheduler calls it at preemption (swap_out), admission (swap_in) and ending (release).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from pagoda.contract.ids import RequestId
from pagoda.contract.step import BlockCopy, StepPlan
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.request import SeqStatus, Sequence


def resume_point(seq: Sequence, num_hit: int) -> int:
    """Where a waiting sequence's computation resumes: its prefix hit, its swapped tokens or its
    migrated KV (tiers/migration.py), leaving at least its last token to compute (a beam's swapped
    KV may cover all its tokens: its candidates were dropped at preemption and come from that last
    token's logits)."""
    handoff = seq.request.kv_import
    imported = handoff.num_tokens if handoff is not None and seq.seq_index == 0 else 0
    return min(max(num_hit, seq.num_swapped_tokens, imported), len(seq.token_ids) - 1)


class SwapManager:
    def __init__(self, num_cpu_blocks: int, block_size: int, mode: str | None, threshold: int) -> None:
        self.pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self._block_size = block_size
        self._mode = mode  # preemption_mode: "recompute", "swap", or None (auto)
        self._threshold = threshold  # auto swaps what recomputing would not fit in one chunk
        self._swapped: dict[RequestId, Sequence] = {}  # sequences whose KV is in host blocks
        self.num_swap_preemptions = 0  # preemptions that swapped (the rest recomputed)
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def cpu_kv_usage(self) -> float:
        pool = self.pool
        return pool.num_used / pool.num_blocks if pool is not None else 0.0

    def swap_out(self, seq: Sequence, plan: StepPlan) -> None:
        """At preemption, before its device blocks are dropped: copy its computed KV to the host
        when the mode chooses to and the host pool has room (otherwise it will recompute)."""
        pool, mode = self.pool, self._mode
        num_blocks = cdiv(seq.num_computed_tokens, self._block_size)
        if pool is None or mode == "recompute" or not num_blocks or not pool.can_allocate(num_blocks):
            return
        if seq.num_window_freed:  # part of its KV is gone (out of the window): swap-in cannot restore it
            return
        if seq.request.sampling.pooling:  # the worker drops its mean-pooling sum with its state: the
            return  # KV alone cannot resume it, so it recomputes (worker_svc/pooling.py)
        if mode is None and seq.num_computed_tokens <= self._threshold:
            return  # auto: recomputing it fits in one prefill chunk
        host = pool.allocate(num_blocks)
        plan.swap_out.extend(BlockCopy(src, dst) for src, dst in zip(seq.block_table[:num_blocks], host, strict=True))
        seq.host_blocks = host
        seq.num_swapped_tokens = seq.num_computed_tokens
        self._swapped[seq.seq_id] = seq
        self.num_swap_preemptions += 1
        self.blocks_swapped_out += num_blocks

    def swap_in(self, seq: Sequence, num_hit_blocks: int, plan: StepPlan) -> None:
        """At resumption, once its device table is allocated (prefix hits first): fill the blocks
        the hits do not cover from its host blocks, then free those."""
        host = seq.host_blocks
        if seq.num_swapped_tokens > num_hit_blocks * self._block_size:
            copies = [BlockCopy(src, dst) for src, dst in
                      zip(host[num_hit_blocks:], seq.block_table[num_hit_blocks:len(host)], strict=True)]
            plan.swap_in.extend(copies)
            self.blocks_swapped_in += len(copies)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Its host blocks back to the pool (swapped in, or ended while swapped)."""
        if seq.host_blocks:
            self.pool.free(seq.host_blocks)  # type: ignore[union-attr]  # blocks imply a pool
            seq.host_blocks = []
        seq.num_swapped_tokens = 0
        self._swapped.pop(seq.seq_id, None)

    def reset(self) -> None:
        """The worker's host pool is gone with its state (worker loss, failed step)."""
        for seq in self._swapped.values():
            seq.host_blocks = []
            seq.num_swapped_tokens = 0
        self._swapped.clear()
        if self.pool is not None:
            self.pool.reset()

    def check(self, live: Mapping[RequestId, Sequence]) -> None:
        """Every host block is free or held by exactly one swapped (waiting) sequence."""
        owners: Counter[int] = Counter()
        holders = set()
        for seq in live.values():
            if not (seq.host_blocks or seq.num_swapped_tokens):
                continue
            holders.add(seq.seq_id)
            if seq.status is not SeqStatus.WAITING or self._swapped.get(seq.seq_id) is not seq:
                raise AssertionError(f"{seq.seq_id} holds host blocks {seq.host_blocks} with status "
                                     f"{seq.status} (tracked: {seq.seq_id in self._swapped})")
            if len(seq.host_blocks) != cdiv(seq.num_swapped_tokens, self._block_size):
                raise AssertionError(f"{seq.seq_id}: {seq.num_swapped_tokens} swapped tokens in host "
                                     f"blocks {seq.host_blocks}")
            owners.update(seq.host_blocks)
        if holders != set(self._swapped):
            raise AssertionError(f"swapped sequences {sorted(self._swapped)} but host blocks held by "
                                 f"{sorted(holders)}")
        pool = self.pool
        if pool is None:
            return
        pool.check()
        for block in range(pool.num_blocks):
            if owners[block] != pool.ref_count(block):
                raise AssertionError(f"host block {block}: ref count {pool.ref_count(block)} but held "
                                     f"by {owners[block]} swapped sequences")
