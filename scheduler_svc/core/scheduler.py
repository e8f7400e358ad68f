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

Shape: `Scheduler` declares the whole public API here and runs the per-step path (schedule the
running, preempt, fork, apply results, finish). What keeps state is an object it holds and calls,
each owning its own: the KV manager (kv_cache_manager.py), the run queues (queues.py), admission
(admission.py), the swap manager (swap.py), the brownout governor (brownout.py), the poison isolator
(poison.py), the prompt pinner (pinning.py), the session leases (tiers/sessions.py) and their
saves (tiers/snapshots.py), live migration's exports and imports (tiers/migration.py), the host
tier (tiers/host_tier.py, in the KV manager), the speculator (spec/), the beam groups
(beam_group.py), the tenants' caps, fair share and totals (tenants.py) and the counters
(outputs.py). They get the KV manager, the run queues and callbacks, never the Scheduler. Invariants: check_invariants (block accounting, queues, host pool).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason
from pagoda.contract.step import DiskBlock, Fork, StepPlan, StepResult, TableUpdate
from scheduler_svc.core.admission import Admission, adapter_names
from scheduler_svc.core.beam_group import BeamGroups
from scheduler_svc.core.brownout import BrownoutChange, BrownoutGovernor
from scheduler_svc.core.config import SchedulerConfig, check_request
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.outputs import SchedulerCounters, SchedulerStats, SequenceDelta
from scheduler_svc.core.pinning import PromptPinner
from scheduler_svc.core.poison import PoisonIsolator
from scheduler_svc.core.prompt_logprobs import attach_prompt_logprobs, fold_prompt_logprobs
from scheduler_svc.core.queues import RunQueues
from scheduler_svc.core.request import EngineRequest, KvHandoff, Request, SeqStatus, Sequence, new_beam_group
from scheduler_svc.core.spec import make_speculator
from scheduler_svc.core.step_draft import InflightStep, StepDraft, register_after_abort
from scheduler_svc.core.swap import SwapManager
from scheduler_svc.core.tenants import Tenants
from scheduler_svc.core.tiers.disk_tier import disk_tier_stats
from scheduler_svc.core.tiers.host_tier import tier_stats
from scheduler_svc.core.tiers.migration import Migrator
from scheduler_svc.core.tiers.sessions import SessionLeases
from scheduler_svc.core.tiers.snapshots import SessionSave, SessionSaves

__all__ = ["Scheduler", "SchedulerStats"]


class Scheduler:
    """The engine's core, driven by one caller thread: add_request / abort / pin_prompt /
    export_request (live migration; take_migrated_after_loss after a worker loss) /
    end_session / save_session (take_saved_sessions when their steps reported) in;
    schedule() -> StepPlan out, update(StepResult) -> deltas back (at most max_inflight_steps plans
    out); note_step_failure / reset_after_worker_loss / fail_all when the worker fails; stats(),
    check_invariants() and the read-only properties below for the engine loop and tests."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        bs = config.block_size
        self._kv = KVCacheManager(config.num_blocks, bs, config.enable_prefix_caching, config.sliding_window,
                                  config.num_cpu_blocks, config.num_offload_blocks, config.num_disk_blocks)
        self._threshold = config.long_prefill_token_threshold or max(1, config.max_num_batched_tokens // 2)
        self._queues = RunQueues(config.policy)
        self._inflight: deque[InflightStep] = deque()
        self._next_step_id = 1
        self._finished_resident: list[RequestId] = []  # ended since the last plan; the worker drops them
        self._arrivals = itertools.count()
        self._prompt_logprobs_ready: dict[RequestId, Request] = {}  # complete, not handed out yet
        self._counters = SchedulerCounters()
        self._pool_preempted = False  # this step preempted for want of pool blocks
        self._capped_preempted: set[str] = set()  # tenants that preempted this step for their own cap
        self._isolator = PoisonIsolator(config.max_step_failures)
        spec = config.speculative
        self._spec = make_speculator(spec, self._kv, self._threshold) if spec is not None else None
        self._pins = PromptPinner(self._kv, self._queues.requests, self.add_request)
        self._leases = SessionLeases(self._kv, clock)  # `clock`: the session TTLs' (tests pass their own)
        self._brownout = BrownoutGovernor(config.brownout, config.max_num_batched_tokens, config.max_num_seqs)
        self._beams = BeamGroups(self._kv, self._queues, self._threshold, make_room=self._preempt_until_fits,
                                 preempt_one=self._preempt_one, finish=self._finish,
                                 last_inflight=self._last_inflight)
        self._swap = SwapManager(config.num_cpu_blocks, bs, config.preemption_mode, self._threshold)
        self._tenants = Tenants(self._kv.pool, config.tenant_kv_share, config.tenant_fairness,
                                config.vtc_prompt_weight, config.vtc_output_weight)
        self._migrator = Migrator(bs, config.kv_migration, config.kv_transfer_address)
        self._saves = SessionSaves(bs, config.kv_snapshots)
        self._migrated_after_loss: list[SequenceDelta] = []  # reset_after_worker_loss's, for the loop
        self._admission = Admission(config, self._threshold, self._kv, self._queues, self._swap,
                                    self._brownout, self._counters, preempt=self._preempt,
                                    tenants=self._tenants, demote=self._leases.demote_one,
                                    migrator=self._migrator)
        # Speculation needs every sequence's last token to propose: one step in flight at a time.
        self.max_inflight_steps = 1 if spec is not None else config.max_inflight_steps
        self.last_failure: str | None = None  # fail_all's reason

    # == the public API ===========================================================================
    # -- requests in --------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises InvalidRequestError or QueueFullError (nothing queued then)."""
        rid, prompt, sampling = request.request_id, request.prompt_token_ids, request.sampling
        q = self._queues
        if rid in q.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        max_tokens = check_request(self.config, request, len(q.waiting), q.waiting.num_tokens,
                                   self._tenants.cap_for(request.tenant, request.kv_share))
        if request.session_id is not None and not request.session_ttl > 0:
            raise InvalidRequestError("a session_id needs a positive retain TTL (seconds)")
        num_seqs = sampling.beam_width or sampling.n
        stop_set = sampling.stop_tokens(self.config.eos_token_ids)
        req = Request(rid, tuple(prompt), sampling, max_tokens, request.priority, request.arrival_time,
                      next(self._arrivals), request.cache_salt, request.lora, num_unfinished=num_seqs,
                      stop_token_set=stop_set, num_prior_output_tokens=request.num_prior_output_tokens,
                      session_id=request.session_id, session_ttl=request.session_ttl,
                      tenant=request.tenant, kv_import=self._checked_import(request),
                      mm_inputs=request.mm_inputs)
        seq = Sequence(rid, 0, req, list(prompt), pending_fork=num_seqs > 1)
        req.seqs.append(seq)
        if sampling.beam_width:
            req.beam = new_beam_group(seq, stop_set)
        q.requests[rid] = req
        q.live[rid] = seq
        q.waiting.push_back(seq)
        self._tenants.arrive(request.tenant, request.kv_share)

    def export_request(self, request_id: RequestId, migration_id: str) -> list[SequenceDelta] | None:
        """Live migration (tiers/migration.py): end the request here with MIGRATED, its KV exported
        under `migration_id`. A running one is detached by the next plan and its delta comes from
        the update() of that plan's step ([] now); a waiting one ends now, with an empty handoff
        (its deltas now). None if unknown or ended; InvalidRequestError for what one continuation
        cannot carry on (n > 1, beam search, pooling)."""
        req = self._queues.requests.get(request_id)
        if req is None or self._pins.is_pin(req):
            return None
        if req.num_seqs != 1 or req.sampling.pooling:
            raise InvalidRequestError("only a request with one sequence (n = 1, no beam search, no pooling) "
                                      "can be migrated")
        seq = req.seqs[0]
        if seq.status is SeqStatus.RUNNING:
            self._migrator.asked[seq] = migration_id
            return []
        return self._end_migrated(req, KvHandoff(migration_id, 0, 0))

    def take_migrated_after_loss(self) -> list[SequenceDelta]:
        """The MIGRATED deltas a worker loss released (their exports may not have run: empty
        handoffs, the targets recompute); the engine loop sends them after reset_after_worker_loss."""
        deltas, self._migrated_after_loss = self._migrated_after_loss, []
        return deltas

    def pin_prompt(self, token_ids: list[int] | tuple[int, ...]) -> RequestId:
        """Prefill `token_ids` and keep its full blocks cached for the engine's life (pinning.py)."""
        return self._pins.pin(token_ids)

    def end_session(self, cache_salt: str | None, session_id: str) -> bool:
        """End a session's lease now (its blocks become ordinary cached blocks); False if it has none."""
        return self._leases.end(cache_salt, session_id)

    def save_session(self, cache_salt: str | None, session_id: str, name: str) -> SessionSave | None:
        """Write the session lease's blocks as snapshot `name` in the next plan (tiers/snapshots.py);
        done when take_saved_sessions() returns it. None: no lease; InvalidRequestError: unsavable."""
        lease = self._leases.get(cache_salt, session_id)
        if lease is None or self._kv.index is None:  # (no prefix caching: no lease holds blocks)
            return None
        return self._saves.ask(lease, session_id, name, self._kv.index)

    def take_saved_sessions(self) -> list[SessionSave]:
        """Saves whose step reported since the last call (and those a worker loss failed: ok False)."""
        return self._saves.take_done()

    def abort(self, request_id: RequestId) -> list[SequenceDelta]:
        """ABORT deltas for the request's unfinished sequences; [] if unknown or already ended."""
        req = self._queues.requests.get(request_id)
        if req is None:
            return []
        if self._kv.index is not None:
            for seq in req.seqs:
                if seq.status is SeqStatus.RUNNING:
                    register_after_abort(self._inflight, seq)
        return self._end_request(req, FinishReason.ABORT)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step plan; None when there is nothing to compute or tell the worker, or when
        `max_inflight_steps` plans are already out (call `update` first)."""
        if len(self._inflight) >= self.max_inflight_steps:
            return None
        brownout = self._brownout
        if brownout.enabled:  # sustained memory pressure: smaller steps, capped max_tokens
            pool = self._kv.pool
            brownout.observe(pool.num_used / pool.num_blocks, self._counters.num_preemptions)
        self._leases.expire()  # sessions whose TTL has passed let their blocks go
        if self._isolator.suspects:  # a step failed: run the suspects one by one first (poison.py)
            return self._schedule_probe()
        plan = self._new_plan()
        if self._migrator.asked:  # before scheduling: the migrating sequences leave in this plan
            self._detach_migrating(plan)
        draft = StepDraft(plan, brownout.step_budget, self.config.block_size,
                          encoder_budget=self.config.encoder_budget, encoder_full=self.config.encoder_budget)
        self._pool_preempted, self._capped_preempted = False, set()
        self._schedule_running(draft)
        # After a preemption for want of pool blocks nothing is admitted (it would take them back);
        # one for a tenant's own cap leaves the pool's room to the other tenants: they are admitted,
        # that tenant is not (its victim would come straight back).
        if not draft.blocks_short and not self._pool_preempted \
                and (not plan.preempted_ids or self._capped_preempted):
            self._admission.admit_waiting(draft, self._capped_preempted)
        if not (draft.num_scheduled or plan.finished_ids or plan.preempted_ids or plan.beam_updates
                or plan.kv_exports):
            return None
        return self._seal(plan, draft)

    def update(self, result: StepResult) -> list[SequenceDelta]:
        """Apply one step's sampled tokens (steps in order); return the sequences' deltas."""
        if not self._inflight or self._inflight[0].step_id != result.step_id:
            expected = self._inflight[0].step_id if self._inflight else None
            raise ValueError(f"result for step {result.step_id}, expected step {expected}")
        step = self._inflight.popleft()
        self._counters.encoder_tokens += result.num_encoder_tokens
        self._counters.encoder_cache_hits += result.num_encoder_cache_hits
        kv = self._kv
        if kv.index is not None:
            kv.register_reported(step.computed)
        if self._spec is not None:
            self._spec.observe_step_cost(step.num_tokens, result.forward_seconds + result.sample_seconds)
        if result.prompt_logprobs:
            fold_prompt_logprobs(self._queues.live, result.prompt_logprobs, self._prompt_logprobs_ready)
        deltas = self._append_tokens(result)
        if self._prompt_logprobs_ready:
            attach_prompt_logprobs(deltas, self._prompt_logprobs_ready, self._queues.requests)
        if step.spec:  # (only a speculator drafts)
            self._spec.settle(step.spec, result.request_ids,  # type: ignore[union-attr]
                              self._last_inflight())
        if self._isolator.probe is not None:
            self._isolator.reported(step.step_id, result.request_ids)
        kv.step_reported(step.step_id)
        self._saves.reported(step.step_id)
        return deltas + self._migrator.reported(step.step_id)

    # -- failures -----------------------------------------------------------------------------
    def note_step_failure(self, step_id: int, message: str) -> list[SequenceDelta]:
        """The worker failed step `step_id` (call before reset_after_worker_loss). Returns ERROR
        deltas, each carrying `message`, for the requests convicted (poison.py); the rest become
        suspects, run alone first."""
        deltas: list[SequenceDelta] = []
        for req in self._isolator.blame(step_id, self._queues.running):
            ended = self._end_request(req, FinishReason.ERROR)
            for delta in ended:
                delta.error = message
            deltas += ended
        return deltas

    def reset_after_worker_loss(self) -> None:
        """A new worker knows nothing: everything resident is preempted to the front of the queue,
        in-flight steps (and their placeholder tokens) are discarded, the prefix index purged, every
        block returns to the pool and the next plan is step 1."""
        self._counters.num_preemptions += self._queues.requeue_all()
        self._brownout.rebase(self._counters.num_preemptions)  # a worker loss is not memory pressure
        self._isolator.probe = None  # discarded with the other in-flight steps; its suspect stays one
        asked = self._migrator.asked  # not detached yet: they move now, to recompute on their target
        self._migrated_after_loss += self._migrator.reset()
        self._saves.reset()
        for seq, migration_id in asked.items():
            if seq.status is not SeqStatus.FINISHED:
                self._migrated_after_loss += self._end_migrated(seq.request, KvHandoff(migration_id, 0, 0))
        self._reset_worker_state()  # the host pool's contents went with the worker: they recompute

    def restore_disk_tier(self, blocks: tuple[DiskBlock, ...]) -> None:
        """The worker's Init listed the files of its disk tier (at start, and again after every
        loss and reconnect): they become the disk index, so prefixes written before a worker
        restart are hits again (tiers/disk_tier.py). No-op without the tier."""
        if self._kv.disk is not None:
            self._kv.disk.restore(blocks)

    def fail_all(self, reason: str) -> list[SequenceDelta]:
        """ERROR for every unfinished sequence (the worker is gone for good); the core is emptied."""
        self.last_failure = reason
        deltas: list[SequenceDelta] = []
        for req in list(self._queues.requests.values()):
            deltas += self._end_request(req, FinishReason.ERROR)
        self._isolator.reset()
        self._migrator.reset()  # their requests ended already: the engine loop fails their streams
        self._saves.reset()
        self._reset_worker_state()
        return deltas

    def brownout_idle(self) -> None:
        """The engine has nothing to run: leave brownout now (called by the engine loop)."""
        self._brownout.leave_idle()

    # -- queries ------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._queues.requests)

    def num_cached_tokens(self, request_id: RequestId) -> int:
        req = self._queues.requests.get(request_id)
        return req.num_cached_tokens if req is not None else 0

    def running_request_ids(self, plan: StepPlan) -> list[RequestId]:
        """The caller-level ids of the requests `plan` (just returned by schedule(), nothing changed
        since) computes tokens for, each once: the running sequences but those it skips (count 0).
        A sequence preempted by the plan has left the running list. O(running): call it only when
        the answer is used (the step span's links, with tracing on)."""
        counts = plan.num_scheduled_tokens
        return list(dict.fromkeys(seq.request.request_id for seq in self._queues.running
                                  if counts.get(seq.seq_id, 1)))

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    @property
    def step_budget(self) -> int:
        """The token budget of the next step (max_num_batched_tokens, lower in brownout)."""
        return self._brownout.step_budget

    @property
    def brownout_active(self) -> bool:
        return self._brownout.active

    @property
    def brownout_changes(self) -> deque[BrownoutChange]:
        """Brownout transitions not yet taken by the engine loop (it pops them)."""
        return self._brownout.changes

    @property
    def isolating(self) -> bool:
        """True while suspects are being probed one at a time."""
        return bool(self._isolator.suspects)

    @property
    def pins_pending(self) -> bool:
        """True until every pinned prompt has been prefilled (and its blocks pinned)."""
        return self._pins.pending

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pins.blocks)

    @property
    def num_sessions(self) -> int:
        """Live session leases (tiers/sessions.py), with or without blocks."""
        return len(self._leases)

    @property
    def num_session_blocks(self) -> int:
        return self._leases.num_blocks

    @property
    def num_swapped(self) -> int:
        return self._swap.num_swapped

    @property
    def cpu_kv_usage(self) -> float:
        return self._swap.cpu_kv_usage

    @property
    def spec_num_drafts(self) -> int:
        return self._spec.num_drafts if self._spec is not None else 0

    @property
    def spec_num_draft_tokens(self) -> int:
        return self._spec.num_draft_tokens if self._spec is not None else 0

    @property
    def spec_num_accepted_tokens(self) -> int:
        return self._spec.num_accepted_tokens if self._spec is not None else 0

    def stats(self) -> SchedulerStats:
        pool, q, c, spec = self._kv.pool, self._queues, self._counters, self._spec
        brownout, swap, isolator = self._brownout, self._swap, self._isolator
        per_pos = spec.accepted_per_pos if spec is not None else {}
        return SchedulerStats(
            len(q.running), len(q.waiting), pool.num_free, pool.num_evictable, pool.num_used,
            pool.num_used / pool.num_blocks, c.prefix_queries, c.prefix_hits,
            c.num_preemptions, c.prompt_tokens, c.generation_tokens, *c.last_step,
            sum(seq.num_computed_tokens for seq in q.running),
            pool.num_allocated_total, pool.num_freed_total, isolator.num_step_failures,
            isolator.num_requests_isolated, self.spec_num_drafts, self.spec_num_draft_tokens,
            self.spec_num_accepted_tokens, tuple(per_pos[i] for i in range(len(per_pos))),
            len(self._pins.blocks), brownout_active=brownout.active,
            brownout_entries=brownout.entries, brownout_capped_requests=brownout.capped_requests,
            running_lora_adapters=adapter_names(q.running), waiting_lora_adapters=adapter_names(q.waiting),
            max_loras=self.config.max_loras, num_swapped=swap.num_swapped,
            num_swap_preemptions=swap.num_swap_preemptions, blocks_swapped_out=swap.blocks_swapped_out,
            blocks_swapped_in=swap.blocks_swapped_in, num_cpu_blocks=self.config.num_cpu_blocks,
            cpu_kv_usage=swap.cpu_kv_usage, prefill_tokens_computed=c.prefill_tokens_computed,
            encoder_tokens=c.encoder_tokens, encoder_cache_hits=c.encoder_cache_hits,
            last_step_images=c.last_step_images,
            num_sessions=len(self._leases), num_session_blocks=self._leases.num_blocks,
            tenants=self._tenants.stats(q.waiting.lengths()),
            **tier_stats(self._kv.tier), **disk_tier_stats(self._kv.disk))

    def check_invariants(self) -> None:
        """Raise AssertionError with details when the block accounting is off (O(total): tests)."""
        held = self._queues.check(self.config.block_size)  # the running tables' references
        held.update(self._pins.blocks)
        held.update(self._leases.held_blocks())
        self._kv.check_refs(held)
        self._queues.check_counts(self.config.max_num_seqs)
        self._swap.check(self._queues.live)

    # == the per-step path ========================================================================
    def _new_plan(self) -> StepPlan:
        plan = StepPlan(step_id=self._next_step_id, finished_ids=self._finished_resident,
                        beam_updates=self._beams.take_updates())
        self._finished_resident = []
        self._saves.plan(plan)  # first: before this plan's allocations may reuse a block
        return plan

    def _seal(self, plan: StepPlan, draft: StepDraft) -> StepPlan:
        """Fork, record the step as in flight, and hand the plan out."""
        for parent in draft.fork_parents:  # after admission: the children run behind admitted ones
            self._fork(parent, plan)
        num_tokens = draft.num_prefill + draft.num_decode + sum(n for _, _, n in draft.spec)
        self._inflight.append(InflightStep(plan.step_id, draft.computed, draft.spec, num_tokens))
        self._counters.last_step = (draft.num_prefill, draft.num_decode, len(plan.preempted_ids))
        self._counters.last_step_images = tuple(draft.images)
        self._counters.prefill_tokens_computed += draft.num_prefill
        self._kv.seal(plan)  # the host and disk tiers' copies of the blocks this plan evicted
        self._next_step_id += 1
        return plan

    def _detach_migrating(self, plan: StepPlan) -> None:
        """The sequences asked to migrate leave in `plan`: their KV exported first (tiers/migration.py),
        then ended as an abort ends them; their deltas wait for this step's report."""
        asked, self._migrator.asked = self._migrator.asked, {}
        for seq, migration_id in asked.items():
            if seq.status is SeqStatus.FINISHED:
                continue  # ended meanwhile (its last token, an abort): nothing to move
            handoff = KvHandoff(migration_id, 0, 0)
            if seq.status is SeqStatus.RUNNING:
                handoff = self._migrator.export(seq, migration_id, plan)
            self._migrator.hold(plan.step_id, self._end_migrated(seq.request, handoff))
        plan.finished_ids += self._finished_resident  # the worker drops them after the export
        self._finished_resident = []

    def _end_migrated(self, req: Request, handoff: KvHandoff) -> list[SequenceDelta]:
        deltas = self._end_request(req, FinishReason.MIGRATED)
        for delta in deltas:
            delta.migration = handoff
        return deltas

    def _checked_import(self, request: EngineRequest) -> KvHandoff | None:
        """A continuation's KV import, or None when this worker cannot import (it recomputes)."""
        handoff = request.kv_import
        if handoff is None or not handoff.num_blocks or \
                not (self.config.kv_snapshots if handoff.snapshot else self.config.kv_migration):
            return None
        if not handoff.snapshot and bool(handoff.source) != bool(self.config.kv_transfer_address):
            return None  # exported in the folder, imported over gRPC or the reverse: recompute
        bs = self.config.block_size
        if not 0 < handoff.num_tokens <= len(request.prompt_token_ids) or \
                handoff.num_blocks != -(-handoff.num_tokens // bs) or request.sampling.n != 1:
            raise InvalidRequestError(f"kv_import of {handoff.num_tokens} tokens in {handoff.num_blocks} blocks "
                                      f"does not fit a {len(request.prompt_token_ids)}-token continuation")
        return handoff

    def _last_inflight(self) -> int | None:
        return self._inflight[-1].step_id if self._inflight else None

    def _schedule_running(self, draft: StepDraft, running: list[Sequence] | None = None) -> None:
        """Schedule the running sequences (or `running`, a sublist of them), in order."""
        kv, plan = self._kv, draft.plan
        running = self._queues.running if running is None else running
        counts, computed = plan.num_scheduled_tokens, draft.computed
        pool, table_updates = kv.pool, plan.table_updates
        refs, bs, threshold = pool.ref_counts, self.config.block_size, self._threshold
        budget, num_decode = draft.budget, 0
        spec = self._spec
        drafts = spec.propose(running, self._last_inflight()) if spec is not None else {}
        window = kv.window
        # Pipeline stages: none whose sampled token is in flight (the first stage embeds it before
        # the last stage has drawn it), and about 1/N of the decodes per plan, so that N plans keep
        # N stages busy. Prefill chunks are not capped: the budget bounds them, and a long prompt's
        # chunks must not hold the decodes back.
        group = -(-len(running) // self.max_inflight_steps) if self.config.pipeline_parallel_size > 1 else 0
        i = 0
        while i < len(running):
            seq = running[i]
            i += 1
            start = seq.num_computed_tokens
            total = len(seq.token_ids) + seq.num_placeholders
            req = seq.request
            if group and req.beam is None and (seq.num_placeholders
                                               or (total - start == 1 and num_decode >= group)):
                counts[seq.seq_id] = 0
                continue
            if window and kv.window_freeable(seq):
                self._free_out_of_window(seq)
            if req.beam is not None:  # the whole group at its first beam (beam_group.py)
                budget -= self._beams.schedule(draft, seq, budget)
                if seq.status is not SeqStatus.RUNNING:
                    i = _index_after_leaving(running, i, seq)  # the group preempted itself, whole
                continue
            if seq.seq_id in drafts:
                used = spec.schedule(draft, seq, drafts[seq.seq_id], budget)  # type: ignore[union-attr]
                if used:
                    draft.commit(seq, 1)  # a decode: num_computed up to its last token, 1 placeholder
                    budget -= used
                    continue
            # The steady state, inlined: one decode token that may be sampled, written inside a
            # block the sequence holds alone, or opening one fresh block (no copy-on-write, no
            # preemption). The general path below, grow() and draft.commit() would do exactly
            # this, at several times the cost.
            fits = False
            if total - start == 1 and budget > 0 < threshold \
                    and req.num_prompt_tokens < total < req.max_num_tokens:
                table = seq.block_table
                if start % bs:
                    fits = refs[table[start // bs]] == 1
                elif start == len(table) * bs and pool.can_allocate(1, req.tenant):
                    new = pool.allocate(1, req.tenant)
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
            num_new, _ = draft.encoder_cut(seq, start, num_new)  # images it cannot encode wait
            # A step that would sample a token beyond max_tokens is not scheduled at all.
            if num_new == 0 or (num_new == gap and not seq.may_sample()):
                counts[seq.seq_id] = 0
                continue
            if not (num_new == 1 and start % bs and refs[seq.block_table[start // bs]] == 1):
                if not self._make_room(seq, num_new, plan):
                    if seq.status is not SeqStatus.RUNNING:
                        # It preempted itself: the last one, or its tenant's last (tenant-scoped
                        # preemption); another tenant's sequences may follow it in the list.
                        i = _index_after_leaving(running, i, seq)
                        continue
                    counts[seq.seq_id] = 0
                    continue
                kv.grow(seq, num_new, plan)
            if num_new != 1:
                counts[seq.seq_id] = num_new
            draft.commit(seq, num_new)
            budget -= num_new
            draft.pay_encoder(seq, start, num_new)
        draft.budget = budget
        draft.num_decode += num_decode
        draft.num_scheduled += num_decode

    def _free_out_of_window(self, seq: Sequence) -> None:
        """Blocks out of every layer's window go back to the pool, but not a beam's (its blocks are
        re-pointed between beams, beam_group.py) nor a pinned prompt's (kept cached for good)."""
        if seq.request.beam is None and not self._pins.is_pin(seq.request):
            self._kv.free_out_of_window(seq, self._last_inflight())

    def _make_room(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Preempt from the tail until seq's blocks fit (counting deferred frees, which come back
        when in-flight steps report). False when seq preempted itself or must wait for them."""
        tenant = seq.request.tenant
        need = self._preempt_until_fits(lambda: self._kv.blocks_needed(seq, num_new),
                                        lambda victim: victim is seq, plan, tenant)
        return need is not None and self._kv.pool.can_allocate(need, tenant)

    def _preempt_until_fits(self, blocks_needed: Callable[[], int], is_self: Callable[[Sequence], bool],
                            plan: StepPlan, tenant: str) -> int | None:
        """Preempt the newest running sequences until `blocks_needed()` blocks are free, within
        `tenant`'s cap, or will be once in-flight steps report; its last value, or None when a
        victim `is_self` (the one making room preempted itself: it waits). Recounted after each
        victim: a victim may have shared blocks with it. When only the tenant's cap is short, the
        victims are that tenant's (its newest first): another tenant's blocks would not help."""
        kv, running, pool = self._kv, self._queues.running, self._kv.pool
        need = blocks_needed()
        while not pool.can_allocate(need, tenant):
            pool_short = pool.num_available + kv.num_deferred < need
            if not pool_short and pool.tenant_room(tenant) + kv.deferred_of[tenant] >= need:
                break  # it fits once the in-flight steps report
            # idle sessions' pinned blocks go before running sequences (the tenant's own, if its cap)
            if self._leases.demote_one(None if pool_short else tenant):
                need = blocks_needed()
                continue
            # then a draft model's tables (spec/draft_model.py): the draft recomputes, cheaply
            if self._spec is not None and self._spec.release_one(running, plan.step_id, self._last_inflight()):
                need = blocks_needed()
                continue
            if pool_short:
                victim = running[-1]
                self._pool_preempted = True
            else:
                victim = next(s for s in reversed(running) if s.request.tenant == tenant)
                self._capped_preempted.add(tenant)
            self._preempt(victim, plan)
            if is_self(victim):
                return None
            need = blocks_needed()
        return need

    def _fork(self, parent: Sequence, plan: StepPlan) -> None:
        req = parent.request
        if req.beam is not None:  # beams fork when their candidates are ranked (beam_group.py)
            return
        q = self._queues
        parent.pending_fork = False
        q.running_slots -= req.n - 1  # the children take the slots reserved for them
        children = [parent.fork(index) for index in range(1, req.n)]
        for child in children:
            self._kv.share(self._kv.held_blocks(child))
            q.live[child.seq_id] = child
            q.add_running(child)
        req.seqs.extend(children)
        plan.forks.append(Fork(parent.seq_id, [c.seq_id for c in children]))

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        if seq.request.beam is not None:
            self._beams.preempt(seq, plan)
        else:
            self._preempt_one(seq, plan)

    def _preempt_one(self, seq: Sequence, plan: StepPlan) -> None:
        self._queues.remove_running(seq)
        self._swap.swap_out(seq, plan)  # copies its KV to host blocks if the mode and the host pool allow
        self._drop_blocks(seq)
        if seq.resident:
            plan.preempted_ids.append(seq.seq_id)
            seq.resident = False
        seq.status = SeqStatus.WAITING
        self._queues.waiting.push_front(seq)
        self._counters.num_preemptions += 1

    def _drop_blocks(self, seq: Sequence) -> None:
        self._kv.release(self._kv.held_blocks(seq), self._last_inflight())
        self._kv.release(seq.forget_draft(), self._last_inflight())  # draft-model speculation's
        seq.block_table = []
        seq.num_window_freed = 0
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.last_serial = 0
        seq.generation += 1

    # -- while isolating a failure (poison.py decides who; the plan is built here) ----------------
    def _schedule_probe(self) -> StepPlan | None:
        """The next plan while isolating: the first suspect alone; None while a step is in flight."""
        if self._inflight:
            return None
        q = self._queues
        target = self._isolator.target(q.running, q.waiting)
        if target is None:
            return self.schedule()
        plan = self._new_plan()
        draft = StepDraft(plan, self.config.max_num_batched_tokens, self.config.block_size,
                          encoder_budget=self.config.encoder_budget, encoder_full=self.config.encoder_budget)
        group = None  # a running beam's whole group is scheduled with it (beam_group.py)
        if target.status is SeqStatus.RUNNING:
            group = target.request if target.request.beam is not None else None
            self._schedule_running(draft, [target])
        else:
            self._admission.admit_suspect(draft, target)
        counts = plan.num_scheduled_tokens
        for seq in q.running:  # before forking: a fork's children sample in this step
            if seq is not target and seq.request is not group:  # a beam group runs as one
                counts[seq.seq_id] = 0
        if draft.num_scheduled:
            self._isolator.probe = (plan.step_id, target)
        else:  # it cannot run alone either (nothing is in flight to wait for): stop suspecting it
            self._isolator.suspects.discard(target.seq_id)
            if not plan.finished_ids and not plan.preempted_ids and not plan.kv_exports:
                return self.schedule()
        return self._seal(plan, draft)

    # -- results --------------------------------------------------------------------------------
    def _append_tokens(self, result: StepResult) -> list[SequenceDelta]:
        deltas: list[SequenceDelta] = []
        live, eos = self._queues.live, self.config.eos_token_ids
        token_ids, logprobs = result.token_ids, result.logprobs
        # Pooling requests: the vector rides on the delta of the token sampled in the same step
        embeddings = {e.request_id: e.values for e in result.embeddings} if result.embeddings else None
        num_accepted, previous = 0, None
        # Accepted tokens per tenant (fair share's counters, the totals): counted per token only
        # while several tenants have requests; with one, they are all its.
        single = self._tenants.single_active
        per_tenant: Counter[str] = Counter()
        beam_requests: list[Request] = []
        for i, seq_id in enumerate(result.request_ids):
            seq = live.get(seq_id)
            if seq is None:  # finished (e.g. EOS seen while its next token was in flight): discard
                continue
            token = token_ids[i]
            if seq_id != previous:  # the next entries of a drafted sequence are its other tokens
                seq.num_placeholders -= 1
                previous = seq_id
            req = seq.request
            if req.beam is not None:  # candidates, not a token: ranked once the group reported
                if seq.status is SeqStatus.RUNNING:  # (a preempted beam recomputes them)
                    req.beam.candidates[seq.seq_index] = logprobs[i].top
                    beam_requests.append(req)
                continue
            tokens = seq.token_ids
            tokens.append(token)
            num_accepted += 1
            if single is None:
                per_tenant[req.tenant] += 1
            delta = SequenceDelta(req.request_id, seq.seq_index, [token],
                                  [logprobs[i]] if logprobs and logprobs[i] is not None else [],
                                  None, req.num_prompt_tokens, req.num_cached_tokens)
            if embeddings is not None and seq_id in embeddings:
                delta.embedding = embeddings[seq_id]
            # stop_reason() can only answer for a stop token or at max_tokens: test that first.
            if token in req.stop_token_set or len(tokens) >= req.max_num_tokens:
                reason = seq.stop_reason(token, eos)
                if reason is not None:
                    delta.finish_reason = reason
                    self._finish(seq)
            deltas.append(delta)
        for req in dict.fromkeys(beam_requests):
            if req.request_id in self._queues.requests:
                self._beams.advance(req, deltas)
        self._counters.generation_tokens += num_accepted
        if single is not None and num_accepted:
            per_tenant[single] = num_accepted
        if per_tenant:
            self._tenants.sampled(per_tenant)
        return deltas

    # -- ending -------------------------------------------------------------------------------
    def _end_request(self, req: Request, reason: FinishReason) -> list[SequenceDelta]:
        born = {seq.seq_index: seq for seq in req.seqs}
        deltas = []
        for index in range(req.n):
            seq = born.get(index)
            if req.beam is None and seq is not None and seq.status is SeqStatus.FINISHED:
                continue  # (seq None: a child not forked yet, which ends with its parent)
            deltas.append(SequenceDelta(req.request_id, index, finish_reason=reason,
                                        num_prompt_tokens=req.num_prompt_tokens,
                                        num_cached_tokens=req.num_cached_tokens))
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq)
        return deltas

    def _finish(self, seq: Sequence) -> None:
        """End a sequence once: release its blocks (deferred while in flight), tell the worker."""
        q = self._queues
        del q.live[seq.seq_id]
        if self._spec is not None:  # suffix decoding caches the output, drops the sequence's tree
            self._spec.finished(seq)
        self._isolator.suspects.discard(seq.seq_id)
        if seq.status is SeqStatus.RUNNING:
            self._pins.finishing(seq)  # before its blocks drop: a pin keeps one reference
            self._leases.finishing(seq)  # and a session's lease one
            q.remove_running(seq)
            self._drop_blocks(seq)
        elif seq.status is SeqStatus.WAITING:
            q.waiting.remove(seq)
            self._swap.release(seq)  # swapped out: nothing will read its host blocks
        if seq.resident:
            self._finished_resident.append(seq.seq_id)
            seq.resident = False
        seq.status = SeqStatus.FINISHED
        req = seq.request
        req.num_unfinished -= 1
        if seq.pending_fork:  # ended before forking: its unborn children end with it
            req.num_unfinished -= req.num_seqs - 1
        if req.num_unfinished == 0:
            del q.requests[req.request_id]
            self._tenants.leave(req.tenant)

    def _reset_worker_state(self) -> None:
        """What the worker held is gone (worker loss, fail_all): in-flight steps, owed beam
        updates, the device pool and prefix index, the host pool; the pins queue again."""
        self._inflight.clear()
        self._finished_resident = []
        self._beams.reset()
        self._kv.reset()
        self._swap.reset()
        self._next_step_id = 1
        self._leases.reset()  # the leases stay, without blocks
        self._pins.requeue()  # they run again when a worker is back


def _index_after_leaving(running: list[Sequence], i: int, seq: Sequence) -> int:
    """Where the running loop goes on after `seq` (just before index i) preempted itself: one back
    when it left the list (what followed it moved up), the same when the list is a probe's own
    ([target], which a preemption does not touch: the sequence must not be scheduled again)."""
    return i - 1 if i > len(running) or running[i - 1] is not seq else i
