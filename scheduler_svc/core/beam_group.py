"""Beam search inside the engine, on copy-on-write forks (the ranking itself: beam_search.py).

A beam-search request starts as one sequence: its prompt is prefilled (chunked, prefix hits) like
any other. Every sequence of the request is a *beam*; a step that computes a beam's last token
reports the beam's K best next tokens instead of a sample. Once every live beam has reported, the
ranking picks the next W beams, each (parent beam, token): the scheduler re-points the beams'
block tables at their parents' (blocks shared by ref count; a parent with no child loses its
references, one with several is shared) and tells the worker with `BeamUpdate`s in the next plan.
The first write into a shared partial block copies it (the ordinary copy-on-write of
`KVCacheManager.grow`), so no KV is ever recomputed. The first step forks the prompt's sequence
into W beams this way.

Beams move together: a group is scheduled as a whole (blocks for all its beams, or none of them),
preempted as a whole (a victim's whole group goes back to the queue, in beam order) and admitted
as a whole (admission.py); each beam waits for the others' candidates before the group advances.
The finished hypotheses are returned once, at the end, ranked by length-penalised score.

The group's state is the request's (`Request.beam`, a BeamGroup: request.py). The Scheduler holds
one BeamGroups, which owns the BeamUpdates owed to the next plan and runs the groups through the
scheduler's own primitives, handed to it as callbacks: make room by preempting from the tail,
preempt one sequence, finish one sequence.
"""

from __future__ import annotations

from collections.abc import Callable

from pagoda.contract.params import FinishReason
from pagoda.contract.step import BeamUpdate, StepPlan
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core.beam_search import NextBeam
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.queues import RunQueues
from scheduler_svc.core.request import BeamGroup, Request, SeqStatus, Sequence, child_seq_id
from scheduler_svc.core.step_draft import StepDraft

# (blocks_needed, is_self, plan) -> blocks needed once room is made; None: the group was preempted
MakeRoom = Callable[[Callable[[], int], Callable[[Sequence], bool], StepPlan, str], int | None]


class BeamGroups:
    def __init__(self, kv: KVCacheManager, queues: RunQueues, threshold: int, *, make_room: MakeRoom,
                 preempt_one: Callable[[Sequence, StepPlan], None], finish: Callable[[Sequence], None],
                 last_inflight: Callable[[], int | None]) -> None:
        self._kv = kv
        self._queues = queues
        self._threshold = threshold
        self._make_room = make_room  # Scheduler._preempt_until_fits
        self._preempt_one = preempt_one
        self._finish = finish
        self._last_inflight = last_inflight
        self.updates: list[BeamUpdate] = []  # for the next plan
        self.num_steps = 0  # ranking rounds run (a counter for tests and stats)

    def take_updates(self) -> list[BeamUpdate]:
        """The updates the next plan carries; the list starts afresh."""
        updates, self.updates = self.updates, []
        return updates

    def reset(self) -> None:
        """The worker's state is gone (worker loss, failure): no update is owed, no result awaited."""
        self.updates = []
        for req in self._queues.requests.values():
            if req.beam is not None:
                req.beam.candidates.clear()

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self, draft: StepDraft, seq: Sequence, budget: int) -> int:
        """Schedule the whole group of `seq` (the first of its beams this plan meets); return the
        tokens it takes. Beams still waiting for their step's result, or for the others'
        candidates, sit this step out; the others (recomputing after a preemption) go on."""
        group: BeamGroup = seq.request.beam
        plan = draft.plan
        if group.scheduled_in is plan:
            return 0
        group.scheduled_in = plan
        counts, kv = plan.num_scheduled_tokens, self._kv
        # All of them, but while poison isolation re-admits a group one suspect at a time.
        beams = [beam for beam in group.beams if beam.status is SeqStatus.RUNNING]
        chunks: list[tuple[Sequence, int]] = []
        left = budget
        for beam in beams:
            gap = len(beam.token_ids) - beam.num_computed_tokens
            ready = not beam.num_placeholders and beam.seq_index not in group.candidates
            num_new = min(gap, self._threshold, left) if ready else 0
            left -= num_new
            chunks.append((beam, num_new))
        need = self._make_room(lambda: self._group_blocks_needed(chunks),
                               lambda victim: victim.request is seq.request, plan, seq.request.tenant)
        if need is None:
            return 0  # the group itself was the newest: it waits, whole
        fits = kv.pool.can_allocate(need, seq.request.tenant)
        if not fits:  # waits for blocks in-flight steps free: admission must not take them first
            draft.blocks_short = True
        used = 0
        for beam, num_new in chunks:
            if not num_new or not fits:
                if beam.resident:
                    counts[beam.seq_id] = 0
                continue
            kv.grow(beam, num_new, plan)
            if num_new != 1:
                counts[beam.seq_id] = num_new
            draft.commit(beam, num_new)
            used += num_new
        return used

    def _group_blocks_needed(self, chunks: list[tuple[Sequence, int]]) -> int:
        """New blocks the group's chunks take: appends, plus a copy for each write into a shared
        block but the last holder's (grow() copies while the block's ref count is > 1, so the
        w beams writing into a block held r times make min(w, r - 1) copies)."""
        kv, bs = self._kv, self._kv.block_size
        need, writers = 0, {}
        for beam, num_new in chunks:
            if not num_new:
                continue
            table, start = beam.block_table, beam.num_computed_tokens
            end_block = cdiv(start + num_new, bs)
            need += max(0, end_block - len(table))
            for i in range(start // bs, min(end_block, len(table))):
                writers[table[i]] = writers.get(table[i], 0) + 1
        return need + sum(min(w, kv.pool.ref_count(block) - 1) for block, w in writers.items())

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Preempt `seq`'s whole group: every running beam goes back to the queue, in beam order."""
        group: BeamGroup = seq.request.beam
        group.candidates.clear()  # recomputed on resume
        for beam in reversed(group.beams):
            if beam.status is SeqStatus.RUNNING:
                self._preempt_one(beam, plan)

    # -- results ------------------------------------------------------------------------------
    def advance(self, req: Request, deltas: list[SequenceDelta]) -> None:
        """Rank once every live beam has reported; then re-point the beams, or finish."""
        group: BeamGroup = req.beam
        beams = group.beams
        if len(group.candidates) < len(beams):
            return
        candidates = [group.candidates[j] for j in range(len(beams))]
        group.candidates.clear()
        self.num_steps += 1
        outputs = [beam.token_ids[req.num_prompt_tokens:] for beam in beams]
        nexts = group.search.step(outputs, group.cum_logprobs, candidates, req.max_tokens)
        if group.search.done:
            self._finish_beams(req, deltas)
        else:
            self._repoint_beams(req, nexts)

    def _repoint_beams(self, req: Request, nexts: list[NextBeam]) -> None:
        """Beam j := parent + token, sharing the parent's blocks; the old tables' references go."""
        group: BeamGroup = req.beam
        old = group.beams
        # The old beams' lists are only ever replaced below, never changed in place: referring to
        # them is enough (each new beam gets copies of its parent's).
        snapshots = [(b.token_ids, b.block_table, b.block_hashes, b.num_registered_blocks,
                      b.last_serial, b.num_computed_tokens) for b in old]
        old_tables = [b.block_table for b in old]
        for beam in old[len(nexts):]:  # fewer continue (the others ended): their slots go
            beam.block_table = []
            self._finish(beam)
        beams: list[Sequence] = []
        for j, nb in enumerate(nexts):
            beam = old[j] if j < len(old) else self._new_beam(req, j, beams[-1])
            tokens, table, hashes, registered, serial, computed = snapshots[nb.parent]
            beam.token_ids = tokens + [nb.token_id]
            beam.block_table = list(table)  # own lists: siblings share blocks, not tables
            self._kv.share(table)
            beam.block_hashes, beam.num_registered_blocks, beam.last_serial = list(hashes), registered, serial
            beam.num_computed_tokens = computed
            beam.generation += 1  # facts recorded about the old beam are stale
            self.updates.append(BeamUpdate(beam.seq_id, old[nb.parent].seq_id, nb.token_id))
            beams.append(beam)
        for table in old_tables:
            self._kv.release(table, self._last_inflight())
        if old[0].pending_fork:  # the first fork: the slots reserved for the beams are theirs now
            old[0].pending_fork = False
            self._queues.running_slots -= req.num_seqs - 1
        group.beams = beams
        group.cum_logprobs = [nb.cum_logprob for nb in nexts]

    def _new_beam(self, req: Request, index: int, after: Sequence) -> Sequence:
        """A beam born at the first fork: resident (its BeamUpdate creates it on the worker),
        running right after the group's other beams (a group stays contiguous)."""
        beam = Sequence(child_seq_id(req.request_id, index), index, req, [], status=SeqStatus.RUNNING,
                        resident=True)
        self._queues.live[beam.seq_id] = beam
        req.seqs.append(beam)
        self._queues.insert_running_after(beam, after)
        return beam

    def _finish_beams(self, req: Request, deltas: list[SequenceDelta]) -> None:
        group: BeamGroup = req.beam
        best = group.search.best(req.n)
        for index in range(req.n):
            if index < len(best):
                hyp = best[index]
                deltas.append(SequenceDelta(
                    req.request_id, index, list(hyp.token_ids), [], hyp.finish_reason,
                    req.num_prompt_tokens, req.num_cached_tokens, cumulative_logprob=hyp.cum_logprob))
            else:  # fewer hypotheses than asked (a vocabulary smaller than the candidates): empty
                deltas.append(SequenceDelta(req.request_id, index, [], [], FinishReason.LENGTH,
                                            req.num_prompt_tokens, req.num_cached_tokens))
        for beam in group.beams:
            self._finish(beam)
