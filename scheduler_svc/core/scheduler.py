"""The scheduler core: one rule for every token, a paged block pool, and delta step plans.

Policy, in a few lines:
- Every sequence has `num_computed_tokens`; a step gives it up to (num_tokens - num_computed) tokens,
  at most `long_prefill_token_threshold` and within the step's token budget. Prefill, chunked
  prefill, prefix hits and decode are that one rule; a full prefix hit still computes one token.
- Running sequences go first, in order (FCFS: admission order; "priority": lower value, then
  arrival). When the pool cannot give a sequence its blocks, the newest (lowest-priority) running
  sequence is preempted: all blocks freed, to the front of the waiting queue, resent as a new
  request when resumed, which recomputes its tokens, or, swapped (swap.py), gets its KV back from
  the worker's host pool. Nothing is admitted in a step that preempted.
- Then waiting sequences are admitted in order while `max_num_seqs`, the budget and the pool allow,
  each starting after its verified prefix-cache hit. The first that does not fit stops admission.
- n>1: the prompt is prefilled once; the step that samples its first token forks n-1 children that
  share every block by ref count; the first write into a shared block copies it (copy-on-write).
- Beam search (beam_group.py): a request's beams are scheduled, preempted and admitted as one
  group; their candidates are ranked when all have reported, and the beams re-pointed at their
  parents' blocks (shared, copy-on-write) with BeamUpdates in the next plan.
- Pipelining: up to `max_inflight_steps` plans may be out; a token sampled by an in-flight step is a
  placeholder, blocks a finished/preempted sequence held return to the pool only after the last
  in-flight step reports, and prefix blocks are registered only when their writing step reported.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable

from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.step import Fork, NewRequestData, StepPlan, TableUpdate
from scheduler_svc.core.beam_group import BeamSearchMixin
from scheduler_svc.core.brownout import BrownoutMixin
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.lora_admission import lora_fits
from scheduler_svc.core.pinning import PinningMixin
from scheduler_svc.core.poison import PoisonIsolationMixin
from scheduler_svc.core.request import Request, SeqStatus, Sequence, WaitingQueue, child_seq_id, priority_key
from scheduler_svc.core.scheduler_lifecycle import SchedulerLifecycleMixin, SchedulerStats
from scheduler_svc.core.spec_decode import SpeculationMixin
from scheduler_svc.core.step_draft import InflightStep, StepDraft
from scheduler_svc.core.step_results import StepResultsMixin
from scheduler_svc.core.swap import SwapMixin

__all__ = ["Scheduler", "SchedulerStats"]


class Scheduler(StepResultsMixin, SchedulerLifecycleMixin, PoisonIsolationMixin, SpeculationMixin,
                PinningMixin, BrownoutMixin, BeamSearchMixin, SwapMixin):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._threshold = config.long_prefill_token_threshold or max(1, config.max_num_batched_tokens // 2)
        self._requests: dict[RequestId, Request] = {}
        self._live: dict[RequestId, Sequence] = {}  # unfinished sequences by sequence id
        self._running: list[Sequence] = []
        self._running_slots = 0  # sum of seq.num_slots over running
        self._waiting = WaitingQueue(config.policy)
        self._inflight: deque[InflightStep] = deque()
        self._next_step_id = 1
        self._finished_resident: list[RequestId] = []  # ended since the last plan; the worker drops them
        self._arrivals = itertools.count()
        self._prompt_logprobs_ready: dict[RequestId, Request] = {}  # complete, not handed out yet
        self._init_counters()
        self._init_isolation()
        self._init_speculation()
        self._init_pinning()
        self._init_brownout()
        self._init_beam_search()
        self._init_swap()
        self.max_inflight_steps = 1 if config.speculative else config.max_inflight_steps

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step plan; None when there is nothing to compute or tell the worker, or when
        `max_inflight_steps` plans are already out (call `update` first)."""
        if len(self._inflight) >= self.max_inflight_steps:
            return None
        if self._brownout is not None:  # sustained memory pressure: smaller steps, capped max_tokens
            self._brownout_tick()
        if self._suspects:  # a step failed: run the suspects one by one first (poison.py)
            return self._schedule_probe()
        plan = StepPlan(step_id=self._next_step_id, finished_ids=self._finished_resident,
                        beam_updates=self._beam_updates)
        self._finished_resident = []
        self._beam_updates = []
        draft = StepDraft(plan, self._step_budget)
        self._schedule_running(draft)
        if not plan.preempted_ids and not draft.blocks_short:
            self._admit_waiting(draft)
        if not (draft.num_scheduled or plan.finished_ids or plan.preempted_ids or plan.beam_updates):
            return None
        return self._seal(plan, draft)

    def _seal(self, plan: StepPlan, draft: StepDraft) -> StepPlan:
        """Fork, record the step as in flight, and hand the plan out."""
        for parent in draft.fork_parents:  # after admission: the children run behind admitted ones
            self._fork(parent, plan)
        num_tokens = draft.num_prefill + draft.num_decode + sum(n for _, _, n in draft.spec)
        self._inflight.append(InflightStep(plan.step_id, draft.computed, draft.spec, num_tokens))
        self._note_step(draft.num_prefill, draft.num_decode, len(plan.preempted_ids))
        self._next_step_id += 1
        return plan

    def _last_inflight(self) -> int | None:
        return self._inflight[-1].step_id if self._inflight else None

    def _schedule_running(self, draft: StepDraft, running: list[Sequence] | None = None) -> None:
        """Schedule the running sequences (or `running`, a sublist of them), in order."""
        kv, plan = self._kv, draft.plan
        running = self._running if running is None else running
        counts, computed = plan.num_scheduled_tokens, draft.computed
        pool, table_updates = kv.pool, plan.table_updates
        refs, bs, threshold = pool.ref_counts, self.config.block_size, self._threshold
        budget, num_decode = draft.budget, 0
        drafts = self._plan_drafts(running) if self._spec is not None else {}
        i = 0
        while i < len(running):
            seq = running[i]
            i += 1
            start = seq.num_computed_tokens
            total = len(seq.token_ids) + seq.num_placeholders
            req = seq.request
            if req.beam is not None:  # the whole group at its first beam (beam_group.py)
                budget -= self._schedule_beams(draft, seq, budget)
                continue
            if seq.seq_id in drafts:
                used = self._schedule_drafts(draft, seq, drafts[seq.seq_id], budget)
                if used:
                    budget -= used
                    continue
            # The steady state, inlined: one decode token that may be sampled, written inside a
            # block the sequence holds alone, or opening one fresh block (no copy-on-write, no
            # preemption). The general path below, grow() and _commit_seq would do exactly
            # this, at several times the cost.
            fits = False
            if total - start == 1 and budget > 0 < threshold \
                    and req.num_prompt_tokens < total < req.max_num_tokens:
                table = seq.block_table
                if start % bs:
                    fits = refs[table[start // bs]] == 1
                elif start == len(table) * bs and pool.can_allocate(1):
                    new = pool.allocate(1)
                    table_updates.append(TableUpdate(seq.seq_id, len(table), new))
                    table += new
                    fits = True
            if fits:
                seq.num_computed_tokens = total
                seq.num_placeholders += 1
                if total // bs > seq.num_registered_blocks:
                    computed.append((seq, seq.generation, total))
                if seq.pending_fork:
                    draft.fork_parents.append(seq)
                num_decode += 1
                budget -= 1
                continue
            gap = total - start
            num_new = gap if gap <= threshold and gap <= budget else min(gap, threshold, budget)
            # A step that would sample a token beyond max_tokens is not scheduled at all.
            if num_new == 0 or (num_new == gap and not seq.may_sample()):
                counts[seq.seq_id] = 0
                continue
            if not (num_new == 1 and start % bs and refs[seq.block_table[start // bs]] == 1):
                if not self._make_room(seq, num_new, plan):
                    if seq.status is not SeqStatus.RUNNING:
                        break  # it preempted itself: it was the last one
                    counts[seq.seq_id] = 0
                    continue
                kv.grow(seq, num_new, plan)
            if num_new != 1:
                counts[seq.seq_id] = num_new
            self._commit_seq(draft, seq, num_new)
            budget -= num_new
        draft.budget = budget
        draft.num_decode += num_decode
        draft.num_scheduled += num_decode

    def _commit_seq(self, draft: StepDraft, seq: Sequence, num_new: int) -> None:
        """Advance num_computed (tokens of in-flight steps count); add a placeholder if it samples."""
        total = len(seq.token_ids) + seq.num_placeholders
        if num_new == 1 and total > seq.request.num_prompt_tokens:
            draft.num_decode += 1
        else:
            draft.num_prefill += num_new
        draft.num_scheduled += 1
        end = seq.num_computed_tokens + num_new
        seq.num_computed_tokens = end
        if end // self.config.block_size > seq.num_registered_blocks:
            draft.computed.append((seq, seq.generation, end))
        if end == total:  # it samples
            seq.num_placeholders += 1
            if seq.pending_fork:
                draft.fork_parents.append(seq)

    def _make_room(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Preempt from the tail until seq's blocks fit (counting deferred frees, which come back
        when in-flight steps report). False when seq preempted itself or must wait for them."""
        need = self._preempt_until_fits(lambda: self._kv.blocks_needed(seq, num_new),
                                        lambda victim: victim is seq, plan)
        return need is not None and self._kv.pool.can_allocate(need)

    def _preempt_until_fits(self, blocks_needed: Callable[[], int], is_self: Callable[[Sequence], bool],
                            plan: StepPlan) -> int | None:
        """Preempt the newest running sequences until `blocks_needed()` blocks are free or will be
        once in-flight steps report; its last value, or None when a victim `is_self` (the one
        making room preempted itself: it waits). Recounted after each victim: a victim may have
        shared blocks with it."""
        kv, running = self._kv, self._running
        need = blocks_needed()
        while not kv.pool.can_allocate(need) and kv.pool.num_available + kv.num_deferred < need:
            victim = running[-1]
            self._preempt(victim, plan)
            if is_self(victim):
                return None
            need = blocks_needed()
        return need

    def _admit_waiting(self, draft: StepDraft) -> None:
        cfg, kv, waiting = self.config, self._kv, self._waiting
        while waiting and draft.budget > 0:
            seq = waiting.peek()
            if seq.num_placeholders or self._running_slots + seq.num_slots > cfg.max_num_seqs:
                return  # its last tokens are still in flight / no room: keep the order, try later
            if seq.request.lora is not None and not lora_fits(seq, self._running, cfg.max_loras):
                return  # max_loras other adapters run: it waits (in order) until one drains
            if seq.request.beam is not None and len(seq.request.beam.beams) > 1:
                if not self._admit_beams(draft, seq):
                    return  # the group enters whole, or waits (in order)
                continue
            hits, last_serial = kv.find_cached_prefix(seq)
            num_hit = len(hits) * cfg.block_size
            start = self._resume_point(seq, num_hit)  # past the hit, or past its swapped KV
            num_new = min(len(seq.token_ids) - start, self._threshold, draft.budget)
            if not kv.pool.can_allocate(kv.blocks_to_admit(hits, start + num_new)):
                return
            waiting.pop()
            self._admit(draft, seq, hits, last_serial, num_hit, num_new)

    def _admit(self, draft: StepDraft, seq: Sequence, hits: list[BlockId], last_serial: int, num_hit: int,
               num_new: int) -> None:
        """Make `seq` (just taken off the waiting queue) resident: blocks, plan entry, running.
        `num_new` tokens are computed from its resume point (its hit, or its swapped tokens)."""
        start = self._resume_point(seq, num_hit)
        self._kv.admit(seq, hits, last_serial, start + num_new)
        seq.num_computed_tokens = start
        self._note_admission(seq, num_hit)
        if seq.host_blocks:  # swapped out: its KV comes back from the host
            self._swap_in(seq, len(hits), draft.plan)
        draft.plan.new_requests.append(NewRequestData(
            seq.seq_id, list(seq.token_ids), seq.request.num_prompt_tokens, list(seq.block_table),
            start, num_new, seq.request.sampling, seq.seq_index, seq.request.lora))
        seq.resident = True
        self._add_running(seq)
        self._commit_seq(draft, seq, num_new)
        draft.budget -= num_new

    def _fork(self, parent: Sequence, plan: StepPlan) -> None:
        req = parent.request
        if req.beam is not None:  # beams fork when their candidates are ranked (beam_group.py)
            return
        parent.pending_fork = False
        self._running_slots -= req.n - 1  # the children take the slots reserved for them
        children = []
        for index in range(1, req.n):
            child = Sequence(child_seq_id(req.request_id, index), index, req, list(parent.token_ids),
                             num_computed_tokens=parent.num_computed_tokens, num_placeholders=1,
                             block_table=list(parent.block_table), block_hashes=list(parent.block_hashes),
                             num_registered_blocks=parent.num_registered_blocks,
                             last_serial=parent.last_serial, generation=parent.generation, resident=True)
            self._kv.share(child.block_table)
            self._live[child.seq_id] = child
            self._add_running(child)
            children.append(child)
        req.seqs.extend(children)
        plan.forks.append(Fork(parent.seq_id, [c.seq_id for c in children]))

    def _add_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        self._running_slots += seq.num_slots
        if self.config.policy == "priority":
            bisect.insort(self._running, seq, key=priority_key)
        else:
            self._running.append(seq)

    def _insert_running_after(self, seq: Sequence, after: Sequence) -> None:
        """Running, right behind `after` (a beam group stays contiguous)."""
        if self.config.policy == "priority":
            self._add_running(seq)  # the order key keeps a request's sequences together
            return
        seq.status = SeqStatus.RUNNING
        self._running_slots += seq.num_slots
        index = len(self._running) - 1 if self._running[-1] is after else self._running.index(after)
        self._running.insert(index + 1, seq)

    def _remove_running(self, seq: Sequence) -> None:
        if self._running and self._running[-1] is seq:
            self._running.pop()
        else:
            self._running.remove(seq)
        self._running_slots -= seq.num_slots

    def _drop_blocks(self, seq: Sequence) -> None:
        self._kv.release(seq.block_table, self._last_inflight())
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.last_serial = 0
        seq.generation += 1

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        if seq.request.beam is not None:
            self._preempt_beams(seq, plan)
        else:
            self._preempt_one(seq, plan)

    def _preempt_one(self, seq: Sequence, plan: StepPlan) -> None:
        self._remove_running(seq)
        self._swap_out(seq, plan)  # copies its KV to host blocks if the mode and the host pool allow
        self._drop_blocks(seq)
        if seq.resident:
            plan.preempted_ids.append(seq.seq_id)
            seq.resident = False
        seq.status = SeqStatus.WAITING
        self._waiting.push_front(seq)
        self.num_preemptions += 1
