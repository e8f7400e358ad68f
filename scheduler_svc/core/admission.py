"""Admission: who moves from the waiting queue to the running set, and with what.

- In queue order (or, with `admission_order="cached-first"`, the earliest with fewer uncached
  tokens than the head first: tiers/prefill_order.py), while `max_num_seqs` slots, the step's
  token budget, the worker's LoRA slots and the pool allow; the first that does not fit stops
  admission (the order is kept: no overtaking).
- Tenants (tenants.py): with fair share on, the queue's order is that of the tenant with the
  smallest virtual token counter first (FCFS or priority within a tenant). A request that does not
  fit only because its tenant is at its KV cap does not stop admission: its tenant is skipped for
  the rest of the step (its own leases are demoted first), and other tenants go on.
- A sequence starts after its verified prefix-cache hit (device blocks, then the host tier's and
  the disk tier's, tiers/host_tier.py and disk_tier.py: only at ordinary admission, not a beam group's nor a suspect's), or after its
  swapped KV (swap.py), and computes at most one prefill chunk (`long_prefill_token_threshold`)
  in its first step.
- Room for the whole prompt, not only its first chunk: a sequence is admitted only when the pool
  can still hold the rest of its known tokens after what the running sequences' unfinished
  prefills will take (`_prefill_reserve`). Why: a long prompt admitted for one chunk takes the
  blocks another running prompt needs for its next chunk; one of them is then preempted and its
  chunks computed again. A 32-session, 1-2k-token agent workload through a pool of ~4 sessions
  spent 43% of its prefill that way (255 preemptions; docs/kv_tiers.md, "Benchmark").
- When the pool is short, idle sessions' leases are demoted first (tiers/sessions.py), oldest first.
- A beam group (beam_group.py) enters whole, or waits whole.
- The LoRA rule: at most `max_loras` distinct adapters among the running sequences. Why: the worker
  has `max_loras` device slots and every resident sequence may be scheduled in the same step, so the
  running set, not only one step, must fit them. A waiting sequence whose adapter already runs
  always fits; one with a new adapter waits while all slots are taken.
- While isolating a failed step (poison.py) one suspect is admitted out of order, preempting from
  the tail until it fits: nothing else runs then, so nothing else would ever make room.

The Scheduler holds one Admission; it owns no state of its own beyond what it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagoda.contract.ids import BlockId
from pagoda.contract.step import NewRequestData, StepPlan
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core.brownout import BrownoutGovernor
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.outputs import SchedulerCounters
from scheduler_svc.core.queues import RunQueues
from scheduler_svc.core.request import SeqStatus, Sequence
from scheduler_svc.core.step_draft import StepDraft
from scheduler_svc.core.swap import SwapManager, resume_point
from scheduler_svc.core.tenants import Tenants
from scheduler_svc.core.tiers.migration import Migrator
from scheduler_svc.core.tiers.prefill_order import CachedFirst


class Admission:
    def __init__(self, config: SchedulerConfig, threshold: int, kv: KVCacheManager, queues: RunQueues,
                 swap: SwapManager, brownout: BrownoutGovernor, counters: SchedulerCounters,
                 preempt: Callable[[Sequence, StepPlan], None], tenants: Tenants,
                 demote: Callable[[str | None], bool] = lambda tenant: False,
                 migrator: Migrator | None = None) -> None:
        self._config = config
        self._threshold = threshold
        self._kv = kv
        self._queues = queues
        self._swap = swap  # a swapped sequence's KV comes back at admission
        self._brownout = brownout  # caps a request's max_tokens at its first admission
        self._counters = counters
        self._preempt = preempt  # the scheduler's preemption (a beam takes its group along)
        self._demote = demote  # an idle session's lease lets its blocks go (tiers/sessions.py)
        self._tenants = tenants  # caps are the pool's; fair-share ranks and per-tenant totals
        self._migrator = migrator  # a migrated continuation's KV is loaded at its first admission
        self._order = CachedFirst() if config.cached_first else None

    def admit_waiting(self, draft: StepDraft, skip_tenants: Iterable[str] = ()) -> None:
        """Admit from the head of the waiting queue while everything fits (the policy above);
        `skip_tenants`' requests wait (tenants that preempted their own this step)."""
        cfg, kv, q = self._config, self._kv, self._queues
        waiting = q.waiting
        rank = self._tenants.rank if self._tenants.fair else None
        skip: set[str] = set(skip_tenants)  # tenants at their KV cap this step
        reserve = self._prefill_reserve() if waiting else 0  # steady decode, nothing waiting: no walk
        while waiting and draft.budget > 0:
            head = seq = waiting.peek(rank, skip)
            if seq is None:
                return  # every waiting tenant is at its cap
            if self._order is not None:  # within the head's tenant: fair share and caps stay as they are
                seq = self._order.pick((s for s in waiting if s.request.tenant == head.request.tenant), head,
                                       self._uncached)
            if seq.num_placeholders or q.running_slots + seq.num_slots > cfg.max_num_seqs:
                return  # its last tokens are still in flight / no room: keep the order, try later
            if seq.request.lora is not None and not lora_fits(seq, q.running, cfg.max_loras):
                return  # max_loras other adapters run: it waits (in order) until one drains
            if seq.request.beam is not None and len(seq.request.beam.beams) > 1:
                if not self._admit_group(draft, seq):
                    return  # the group enters whole, or waits (in order)
                continue
            hits, last_serial = kv.find_cached_prefix(seq)
            host = kv.find_offloaded(seq, len(hits))  # the host and disk tiers' hits past the device's
            num_hit = (len(hits) + len(host)) * cfg.block_size
            start = resume_point(seq, num_hit)  # past the hit, or past its swapped KV
            num_new = min(len(seq.token_ids) - start, self._threshold, draft.budget)
            num_new, _ = draft.encoder_cut(seq, start, num_new)
            if num_new == 0:
                return  # its first chunk starts at an image this step cannot encode: wait, in order
            tenant = seq.request.tenant
            short = kv.admit_short(tenant, hits, start + num_new)
            if short is None and not self._fits_whole(seq, hits, reserve):
                short = "pool"  # its first chunk fits, its whole prompt not beside the running ones'
            if short is not None:
                # idle sessions' blocks make room (to the LRU, then the host tier): any tenant's
                # when the pool is short, the tenant's own when its cap is
                if self._demote(None if short == "pool" else tenant):
                    continue
                if short == "pool":
                    return
                skip.add(tenant)
                continue
            waiting.remove(seq)
            draft.pay_encoder(seq, start, num_new)
            self.admit(draft, seq, hits, last_serial, num_hit, num_new, host)
            if self._order is not None:
                self._order.admitted(seq)  # a pass over the head counts once it is admitted
            reserve += self._blocks_to_finish(seq)

    def _fits_whole(self, seq: Sequence, hits: list[BlockId], reserve: int) -> bool:
        """Whether the pool holds all of `seq`'s known tokens beside `reserve`. With a sliding
        window a sequence holds about a window's blocks, not its context's, so the rule is off."""
        if self._config.sliding_window:
            return True
        return self._kv.pool.can_allocate(self._kv.blocks_to_admit(hits, len(seq.token_ids)) + reserve)

    def _prefill_reserve(self) -> int:
        """Blocks the running sequences still need to hold their known tokens (prompts not yet
        fully prefilled; 0 for a decoding one, whose table already covers them). Unused, and not
        summed, under a sliding window (`_fits_whole`)."""
        if self._config.sliding_window:
            return 0
        return sum(self._blocks_to_finish(seq) for seq in self._queues.running)

    def _blocks_to_finish(self, seq: Sequence) -> int:
        return max(0, cdiv(len(seq.token_ids), self._config.block_size) - len(seq.block_table))

    def _uncached(self, seq: Sequence) -> int:
        """Tokens `seq` would compute if admitted now (past its hit on every tier, or its swapped
        KV); a beam group's beams never go out of order (the group enters whole at its head)."""
        if seq.request.beam is not None:
            return len(seq.token_ids) << 20
        hits, _ = self._kv.find_cached_prefix(seq)
        host = self._kv.find_offloaded(seq, len(hits))
        return len(seq.token_ids) - resume_point(seq, (len(hits) + len(host)) * self._config.block_size)

    def admit(self, draft: StepDraft, seq: Sequence, hits: list[BlockId], last_serial: int, num_hit: int,
              num_new: int, host: list[int] | None = None) -> None:
        """Make `seq` (just taken off the waiting queue) resident: blocks, plan entry, running.
        `num_new` tokens are computed from its resume point (its hit, or its swapped tokens); its
        hit is its device `hits` then the host tier's `host` slots (loaded in the plan)."""
        start = resume_point(seq, num_hit)
        self._kv.admit(seq, hits, last_serial, start + num_new, host, draft.plan)
        seq.num_computed_tokens = start
        req = seq.request
        first = self._counters.note_admission(seq, num_hit)
        self._tenants.admitted(req.tenant, req.num_prompt_tokens, len(seq.token_ids) - start, first)
        if first and self._brownout.cap:
            self._brownout.cap_max_tokens(req)  # in brownout: a new request gets the short limit
        if seq.host_blocks:  # swapped out: its KV comes back from the host
            self._swap.swap_in(seq, num_hit // self._config.block_size, draft.plan)
        if req.kv_import is not None and self._migrator is not None:  # migrated: its KV from the files
            self._migrator.load(seq, num_hit, draft.plan)
        draft.plan.new_requests.append(NewRequestData(
            seq.seq_id, list(seq.token_ids), req.worker_num_prompt_tokens, list(seq.block_table),
            start, num_new, req.worker_sampling, seq.seq_index, req.lora, req.mm_inputs))
        seq.resident = True
        self._queues.add_running(seq)
        draft.commit(seq, num_new)
        draft.budget -= num_new

    def _admit_group(self, draft: StepDraft, seq: Sequence) -> bool:
        """Admit every waiting beam of `seq`'s group (at the queue's head, in beam order) or none;
        False when they do not all fit this step."""
        kv, queues = self._kv, self._queues
        bs, waiting = kv.block_size, queues.waiting
        beams = [beam for beam in seq.request.beam.beams if beam.status is SeqStatus.WAITING]
        if queues.running_slots + len(beams) > self._config.max_num_seqs or draft.budget < len(beams) \
                or any(beam.num_placeholders for beam in beams):
            return False
        tenant = seq.request.tenant
        while not kv.pool.can_allocate(self._group_blocks(beams, draft.budget), tenant):
            if not self._demote(None):  # idle sessions' blocks go first (recounted: hits may revive)
                return False
        # Each beam's hits are looked up again just before it is admitted: the blocks the beams
        # before it allocated may have evicted one (never making the total exceed what
        # _group_blocks counted: an evicted hit was counted as a revived block, and is now a new one).
        for k, beam in enumerate(beams):
            hits, last_serial = kv.find_cached_prefix(beam)
            num_hit = len(hits) * bs
            num_new = min(len(beam.token_ids) - resume_point(beam, num_hit), self._threshold,
                          draft.budget - (len(beams) - k - 1))
            waiting.remove(beam)
            self.admit(draft, beam, hits, last_serial, num_hit, num_new)
        return True

    def _group_blocks(self, beams: list[Sequence], budget: int) -> int:
        """Blocks admitting every beam of a group consumes this step."""
        kv, bs = self._kv, self._kv.block_size
        need, left = 0, budget
        for k, beam in enumerate(beams):
            hits, _ = kv.find_cached_prefix(beam)
            start = resume_point(beam, len(hits) * bs)  # its hit or swapped KV
            num_new = min(len(beam.token_ids) - start, self._threshold, left - (len(beams) - k - 1))
            left -= num_new
            need += kv.blocks_to_admit(hits, start + num_new)
        return need

    def admit_suspect(self, draft: StepDraft, target: Sequence) -> None:
        """Admit `target` out of queue order, preempting resident sequences from the tail until it
        fits: nothing else runs while isolating, so nothing else would ever make room."""
        cfg, kv, q = self._config, self._kv, self._queues
        while True:
            hits, last_serial = kv.find_cached_prefix(target)
            num_hit = len(hits) * cfg.block_size
            start = resume_point(target, num_hit)  # past its hit, or its swapped KV
            num_new = min(len(target.token_ids) - start, self._threshold, draft.budget)
            if kv.admit_short(target.request.tenant, hits, start + num_new) is None and \
                    q.running_slots + target.num_slots <= cfg.max_num_seqs and \
                    lora_fits(target, q.running, cfg.max_loras):  # the worker's slots
                break
            if not q.running:
                if self._demote(None):  # idle sessions' blocks go first
                    continue
                return  # cannot happen for an admitted request (add_request checked its size)
            self._preempt(q.running[-1], draft.plan)
        q.waiting.remove(target)
        self.admit(draft, target, hits, last_serial, num_hit, num_new)


def running_adapters(running: Iterable[Sequence]) -> set[str]:
    return {seq.request.lora_key for seq in running if seq.request.lora_key is not None}


def adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The adapters (by name, sorted) of `seqs`, for the stats."""
    return tuple(sorted({seq.request.lora.lora_name for seq in seqs if seq.request.lora is not None}))


def lora_fits(seq: Sequence, running: Iterable[Sequence], max_loras: int) -> bool:
    key = seq.request.lora_key
    if key is None:
        return True
    active = running_adapters(running)
    return key in active or len(active) < max_loras
