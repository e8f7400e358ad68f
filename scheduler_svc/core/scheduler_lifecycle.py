"""The Scheduler's life-cycle and bookkeeping half: admission checks, ending sequences, abort,
worker loss, failure, stats, invariants.

A mixin so scheduler.py stays about the per-step path; it uses the Scheduler's attributes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagoda.contract.errors import InvalidRequestError, QueueFullError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, check_context_length
from pagoda.contract.step import StepPlan
from scheduler_svc.core.beam_group import new_beam_group
from scheduler_svc.core.lora_admission import adapter_names
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.request import EngineRequest, Request, SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int  # sequences
    num_waiting: int  # sequences
    num_free_blocks: int
    num_evictable_blocks: int  # cached prefix blocks with ref 0
    num_used_blocks: int
    kv_usage: float  # used / total, 0..1
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens served from it
    num_preemptions: int  # total
    prompt_tokens: int  # total, counted at a request's first admission
    generation_tokens: int  # total sampled tokens accepted
    last_step_prefill_tokens: int
    last_step_decode_tokens: int
    last_step_preemptions: int
    num_resident_tokens: int  # tokens whose KV the running sequences hold (fragmentation studies)
    blocks_allocated: int = 0  # total blocks taken from the pool (free list or evictable LRU)
    blocks_freed: int = 0  # total blocks returned to it
    num_step_failures: int = 0  # failed steps (the worker's forward or sampler raised)
    num_requests_isolated: int = 0  # requests failed alone for them (poison.py)
    spec_num_drafts: int = 0  # sequence-steps that carried draft tokens (spec_decode.py)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # [i]: drafts accepted at position i (0-based)
    num_pinned_blocks: int = 0  # prefix blocks held for pinned prompts (pinning.py)
    brownout_active: bool = False  # under memory pressure: smaller steps, capped max_tokens (brownout.py)
    brownout_entries: int = 0  # times brownout was entered
    brownout_capped_requests: int = 0  # requests whose max_tokens brownout lowered
    # Multi-LoRA (vLLM's lora_requests_info): adapter names with running / waiting requests
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0  # 0: LoRA off
    # Swap preemption (swap.py)
    num_swapped: int = 0  # waiting sequences (counted in num_waiting) whose KV is in host blocks
    num_swap_preemptions: int = 0  # preemptions that swapped (of num_preemptions)
    blocks_swapped_out: int = 0  # total
    blocks_swapped_in: int = 0  # total
    num_cpu_blocks: int = 0  # the host pool; 0: none
    cpu_kv_usage: float = 0.0  # used / total host blocks, 0..1
    # Tokens computed in prefill chunks, recomputation after preemption included (what swapping saves)
    prefill_tokens_computed: int = 0


class SchedulerLifecycleMixin:
    def _init_counters(self) -> None:
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefill_tokens_computed = 0
        self._last_step = (0, 0, 0)

    def _note_admission(self, seq: Sequence, num_hit: int) -> None:
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += num_hit
        req = seq.request
        if not req.admitted:  # a resumed request's recomputation is not a cache hit (vLLM #25780)
            req.admitted = True
            req.num_cached_tokens = num_hit
            self.prompt_tokens += req.num_prompt_tokens
            if self._brownout_cap:  # in brownout: a newly admitted request gets the short limit
                self._cap_max_tokens(req)

    def _note_step(self, num_prefill: int, num_decode: int, num_preempted: int) -> None:
        self._last_step = (num_prefill, num_decode, num_preempted)
        self.prefill_tokens_computed += num_prefill

    # -- admission (validation; the per-step path is in scheduler.py) ----------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises InvalidRequestError or QueueFullError (nothing queued then)."""
        rid, prompt, sampling = request.request_id, request.prompt_token_ids, request.sampling
        cfg = self.config
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        if not prompt:
            raise InvalidRequestError("the prompt is empty: at least one token is required")
        check_context_length(cfg.max_model_len, len(prompt), sampling.max_tokens)
        max_tokens = cfg.max_model_len - len(prompt) if sampling.max_tokens is None else sampling.max_tokens
        num_seqs = sampling.beam_width or sampling.n
        if num_seqs > cfg.max_num_seqs:
            what = f"beam width {num_seqs}" if sampling.beam_width else f"n={num_seqs}"
            raise InvalidRequestError(f"{what} exceeds max_num_seqs={cfg.max_num_seqs}")
        blocks = -(-(len(prompt) + max_tokens - 1) // cfg.block_size)
        if sampling.beam_width:  # a group runs whole: every beam at full length, at worst unshared
            blocks *= sampling.beam_width
        if blocks > cfg.num_blocks:
            raise InvalidRequestError(f"the request needs {blocks} KV blocks but the cache has only "
                                      f"{cfg.num_blocks}")
        if request.lora is not None and not cfg.max_loras:
            raise InvalidRequestError(f"LoRA adapter {request.lora.lora_name!r} requested, but LoRA is "
                                      "not enabled (start the worker with --enable-lora)")
        if len(self._waiting) >= cfg.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full: {len(self._waiting)} of "
                                 f"{cfg.max_waiting_requests} requests waiting; retry later")
        if cfg.max_waiting_tokens is not None and \
                self._waiting.num_tokens + len(prompt) > cfg.max_waiting_tokens:
            raise QueueFullError(f"the waiting queue is full: {self._waiting.num_tokens} of "
                                 f"{cfg.max_waiting_tokens} prompt tokens waiting; retry later")
        stop_set = sampling.stop_tokens(cfg.eos_token_ids)
        req = Request(rid, tuple(prompt), sampling, max_tokens, request.priority, request.arrival_time,
                      next(self._arrivals), request.cache_salt, request.lora, num_unfinished=num_seqs,
                      stop_token_set=stop_set)
        seq = Sequence(rid, 0, req, list(prompt), pending_fork=num_seqs > 1)
        req.seqs.append(seq)
        if sampling.beam_width:
            req.beam = new_beam_group(seq, stop_set)
        self._requests[rid] = req
        self._live[rid] = seq
        self._waiting.push_back(seq)

    # -- queries ------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    def num_cached_tokens(self, request_id: RequestId) -> int:
        req = self._requests.get(request_id)
        return req.num_cached_tokens if req is not None else 0

    def stats(self) -> SchedulerStats:
        pool = self._kv.pool
        return SchedulerStats(
            len(self._running), len(self._waiting), pool.num_free, pool.num_evictable, pool.num_used,
            pool.num_used / pool.num_blocks, self.prefix_queries, self.prefix_hits,
            self.num_preemptions, self.prompt_tokens, self.generation_tokens, *self._last_step,
            sum(seq.num_computed_tokens for seq in self._running),
            pool.num_allocated_total, pool.num_freed_total, self.num_step_failures,
            self.num_requests_isolated, self.spec_num_drafts, self.spec_num_draft_tokens,
            self.spec_num_accepted_tokens,
            tuple(self.spec_accepted_per_pos[i] for i in range(len(self.spec_accepted_per_pos))),
            len(self._pinned_blocks), brownout_active=self.brownout_active,
            brownout_entries=self.brownout_entries, brownout_capped_requests=self.brownout_capped_requests,
            running_lora_adapters=adapter_names(self._running), waiting_lora_adapters=adapter_names(self._waiting),
            max_loras=self.config.max_loras, num_swapped=self.num_swapped,
            num_swap_preemptions=self.num_swap_preemptions, blocks_swapped_out=self.blocks_swapped_out,
            blocks_swapped_in=self.blocks_swapped_in, num_cpu_blocks=self.config.num_cpu_blocks,
            cpu_kv_usage=self.cpu_kv_usage, prefill_tokens_computed=self.prefill_tokens_computed)

    def running_request_ids(self, plan: StepPlan) -> list[RequestId]:
        """The caller-level ids of the requests `plan` (just returned by schedule(), nothing changed
        since) computes tokens for, each once: the running sequences but those it skips (count 0).
        A sequence preempted by the plan has left the running list. O(running): call it only when
        the answer is used (the step span's links, with tracing on)."""
        counts = plan.num_scheduled_tokens
        return list(dict.fromkeys(seq.request.request_id for seq in self._running
                                  if counts.get(seq.seq_id, 1)))

    # -- ending requests ----------------------------------------------------------------------
    def abort(self, request_id: RequestId) -> list[SequenceDelta]:
        """ABORT deltas for the request's unfinished sequences; [] if unknown or already ended."""
        req = self._requests.get(request_id)
        return [] if req is None else self._end_request(req, FinishReason.ABORT)

    def fail_all(self, reason: str) -> list[SequenceDelta]:
        """ERROR for every unfinished sequence (the worker is gone for good); the core is emptied."""
        self.last_failure = reason
        deltas: list[SequenceDelta] = []
        for req in list(self._requests.values()):
            deltas += self._end_request(req, FinishReason.ERROR)
        self._inflight.clear()
        self._finished_resident = []
        self._reset_beams()
        self._kv.reset()
        self._reset_swap()
        self._next_step_id = 1
        self._reset_isolation()
        self._requeue_pins()  # they run again when a worker is back
        return deltas

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
        del self._live[seq.seq_id]
        self._suspects.discard(seq.seq_id)
        if self._pin_ids and seq.request.request_id in self._pin_ids and seq.status is SeqStatus.RUNNING:
            self._pin_finished(seq)  # before its blocks drop: the pin keeps one reference
        if seq.status is SeqStatus.RUNNING:
            self._remove_running(seq)
            self._drop_blocks(seq)
        elif seq.status is SeqStatus.WAITING:
            self._waiting.remove(seq)
            self._release_host(seq)  # swapped out: nothing will read its host blocks
        if seq.resident:
            self._finished_resident.append(seq.seq_id)
            seq.resident = False
        seq.status = SeqStatus.FINISHED
        req = seq.request
        req.num_unfinished -= 1
        if seq.pending_fork:  # ended before forking: its unborn children end with it
            req.num_unfinished -= req.num_seqs - 1
        if req.num_unfinished == 0:
            del self._requests[req.request_id]

    # -- worker loss --------------------------------------------------------------------------
    def reset_after_worker_loss(self) -> None:
        """A new worker knows nothing: everything resident is preempted to the front of the queue,
        in-flight steps (and their placeholder tokens) are discarded, the prefix index purged, every
        block returns to the pool and the next plan is step 1."""
        for seq in reversed(self._running):  # reversed + push_front: running order is kept
            seq.block_table = []
            seq.num_computed_tokens = 0
            seq.num_registered_blocks = 0
            seq.last_serial = 0
            seq.generation += 1
            seq.resident = False
            seq.status = SeqStatus.WAITING
            self._waiting.push_front(seq)
        self.num_preemptions += len(self._running)
        self._brownout_rebase()  # a worker loss is not memory pressure
        self._running = []
        self._running_slots = 0
        for seq in self._live.values():
            seq.num_placeholders = 0  # those tokens will never arrive; resuming recomputes them
        self._inflight.clear()
        self._probe = None  # discarded with the other in-flight steps; its suspect stays one
        self._finished_resident = []
        self._reset_beams()
        self._kv.reset()
        self._reset_swap()  # the host pool's contents went with the worker: they recompute
        self._next_step_id = 1
        self._requeue_pins()

    # -- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError with details when the block accounting is off (O(total): tests)."""
        pool = self._kv.pool
        pool.check()
        refs: Counter[int] = Counter()
        for seq in self._running:
            if seq.status is not SeqStatus.RUNNING or self._live.get(seq.seq_id) is not seq:
                raise AssertionError(f"{seq.seq_id} is in the running list with status {seq.status}")
            if len(set(seq.block_table)) != len(seq.block_table):
                raise AssertionError(f"{seq.seq_id} holds a block twice: {seq.block_table}")
            if len(seq.block_table) * self.config.block_size < seq.num_computed_tokens:
                raise AssertionError(f"{seq.seq_id}: {seq.num_computed_tokens} computed tokens do not "
                                     f"fit its table {seq.block_table}")
            refs.update(seq.block_table)
        for seq in self._waiting:
            if seq.block_table or seq.status is not SeqStatus.WAITING:
                raise AssertionError(f"waiting {seq.seq_id} holds blocks {seq.block_table}")
        for req in self._requests.values():
            for seq in req.seqs:
                if seq.status is SeqStatus.FINISHED and seq.block_table:
                    raise AssertionError(f"finished {seq.seq_id} still references {seq.block_table}")
        refs.update(self._kv.deferred_blocks())
        refs.update(self._pinned_blocks)
        for block in range(pool.num_blocks):
            if refs[block] != pool.ref_count(block):
                raise AssertionError(f"block {block}: ref count {pool.ref_count(block)} but held by "
                                     f"{refs[block]} tables / deferred frees")
        if len(self._running) + len(self._waiting) != len(self._live):
            raise AssertionError(f"{len(self._live)} live sequences but {len(self._running)} running + "
                                 f"{len(self._waiting)} waiting")
        self._check_swap_invariants()
        slots = sum(seq.num_slots for seq in self._running)
        if slots != self._running_slots or slots > self.config.max_num_seqs:
            raise AssertionError(f"running slots {self._running_slots} (recount {slots}) vs "
                                 f"max_num_seqs {self.config.max_num_seqs}")
