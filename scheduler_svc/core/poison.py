"""Poison isolation: a failing step never loops, and fails only the request that makes it fail.

A step whose forward pass or sampler raised (StepError INTERNAL) leaves the worker's state unknown,
so the engine resyncs as after a worker loss and every resident sequence recomputes. Without more,
a request that always crashes the model would crash every retry, forever, and take every request
batched with it along (issue 20: 66 resyncs in 12 s for one `presence_penalty`). So:

- a failed *mixed* step gives every request with a running sequence a strike, and those sequences
  become suspects;
- while there are suspects, every step is a *probe*: one suspect sequence alone (its recompute,
  chunked if long, up to the step that samples), one step in flight, every other resident sequence
  skipped with 0 tokens. A probe that samples a token clears its suspect; everyone else then runs
  batched again as before;
- a probe that fails convicts its request (it ran alone, and it already failed once batched): the
  request ends with ERROR, every other request keeps its tokens;
- the budget: a request that took part in `max_step_failures` failed steps is failed even when it
  never failed alone (a fault that only shows in a batch), so the loop is bounded by
  max_step_failures x (number of requests) failed steps whatever the worker does.

A mixin for Scheduler (scheduler.py keeps the per-step path); it uses the Scheduler's attributes.
"""

from __future__ import annotations

from pagoda.contract.params import FinishReason
from pagoda.contract.step import StepPlan, StepResult
from scheduler_svc.core.lora_admission import lora_fits
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.request import Request, SeqStatus, Sequence
from scheduler_svc.core.step_draft import StepDraft


class PoisonIsolationMixin:
    def _init_isolation(self) -> None:
        self._suspects: set[str] = set()  # sequence ids to run alone before they batch again
        self._probe: tuple[int, Sequence] | None = None  # (step id, suspect) of the probe in flight
        self.num_step_failures = 0  # failed steps reported to note_step_failure
        self.num_requests_isolated = 0  # requests failed by it

    @property
    def isolating(self) -> bool:
        """True while suspects are being probed one at a time."""
        return bool(self._suspects)

    def note_step_failure(self, step_id: int, message: str) -> list[SequenceDelta]:
        """The worker failed step `step_id` (call before reset_after_worker_loss). Returns ERROR
        deltas, each carrying `message`, for the requests convicted; the rest become suspects."""
        self.num_step_failures += 1
        probe, self._probe = self._probe, None
        solo = probe is not None and probe[0] == step_id and probe[1].status is SeqStatus.RUNNING
        blamed: dict[str, Request] = {}
        for seq in ([probe[1]] if solo else self._running):
            blamed.setdefault(seq.request.request_id, seq.request)
        deltas: list[SequenceDelta] = []
        for req in blamed.values():
            req.num_step_failures += 1
            if solo or req.num_step_failures >= self.config.max_step_failures:
                self.num_requests_isolated += 1
                ended = self._end_request(req, FinishReason.ERROR)
                for delta in ended:
                    delta.error = message
                deltas += ended
            else:
                self._suspects.update(seq.seq_id for seq in req.seqs if seq.status is SeqStatus.RUNNING)
        return deltas

    def _schedule_probe(self) -> StepPlan | None:
        """The next plan while isolating: the first suspect alone; None while a step is in flight."""
        if self._inflight:
            return None
        target = next((s for s in self._running if s.seq_id in self._suspects), None) or \
            next((s for s in self._waiting if s.seq_id in self._suspects), None)
        if target is None:  # (every suspect ended: _finish discards them; defensive)
            self._suspects.clear()
            return self.schedule()
        plan = StepPlan(step_id=self._next_step_id, finished_ids=self._finished_resident,
                        beam_updates=self._beam_updates)
        self._finished_resident = []
        self._beam_updates = []
        draft = StepDraft(plan, self.config.max_num_batched_tokens)
        group = None  # a running beam's whole group is scheduled with it (beam_group.py)
        if target.status is SeqStatus.RUNNING:
            group = target.request if target.request.beam is not None else None
            self._schedule_running(draft, [target])
        else:
            self._admit_probe(draft, target)
        counts = plan.num_scheduled_tokens
        for seq in self._running:  # before forking: a fork's children sample in this step
            if seq is not target and seq.request is not group:  # a beam group runs as one
                counts[seq.seq_id] = 0
        if draft.num_scheduled:
            self._probe = (plan.step_id, target)
        else:  # it cannot run alone either (nothing is in flight to wait for): stop suspecting it
            self._suspects.discard(target.seq_id)
            if not plan.finished_ids and not plan.preempted_ids:
                return self.schedule()
        return self._seal(plan, draft)

    def _admit_probe(self, draft: StepDraft, target: Sequence) -> None:
        """Admit `target` out of queue order, preempting resident sequences from the tail until it
        fits: nothing else runs while isolating, so nothing else would ever make room."""
        kv, bs = self._kv, self.config.block_size
        while True:
            hits, last_serial = kv.find_cached_prefix(target)
            num_hit = len(hits) * bs
            start = self._resume_point(target, num_hit)  # past its hit, or its swapped KV
            num_new = min(len(target.token_ids) - start, self._threshold, draft.budget)
            if kv.pool.can_allocate(kv.blocks_to_admit(hits, start + num_new)) and \
                    self._running_slots + target.num_slots <= self.config.max_num_seqs and \
                    lora_fits(target, self._running, self.config.max_loras):  # the worker's slots
                break
            if not self._running:
                return  # cannot happen for an admitted request (add_request checked its size)
            self._preempt(self._running[-1], draft.plan)
        self._waiting.remove(target)
        self._admit(draft, target, hits, last_serial, num_hit, num_new)

    def _note_probe_reported(self, step_id: int, result: StepResult) -> None:
        probe_step, target = self._probe
        if probe_step != step_id:
            return
        self._probe = None
        if target.seq_id in result.request_ids:  # it sampled: it can batch again
            self._suspects.discard(target.seq_id)

    def _reset_isolation(self) -> None:
        """Everything ended (fail_all): nothing left to suspect."""
        self._suspects.clear()
        self._probe = None
