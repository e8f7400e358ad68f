"""Draft-model speculation, the scheduler's half: who drafts how many, and the draft model's KV.

The proposals come from the worker's draft model (worker_svc/draft_model.py); the scheduler never
sees them before the step reports. What it owns is the draft's KV: every drafting sequence has a
second block table (`Sequence.draft_table`) in the same block pool as its own, allocated here
with the target's blocks for the step (both or neither: drafts never preempt), released with the
sequence's (finish, abort, preemption, swap-out: the draft's KV is not swapped, the draft
recomputes it on resume), and rolled back on rejection like the target's table. Draft blocks are
never prefix-cached: a hit on the target's blocks says nothing about the draft's (another model),
and the draft catches up on a prefix in one batched forward when it first drafts.

Positions: a decoding sequence has computed c tokens and knows its last token (position c). Its
draft cache holds positions [0, n) with n <= c. The worker feeds the draft positions n..c (the
lag: usually 0 or 1 token before the last, a whole prompt at the first draft), then k - 1 of its
own proposals, writing the draft's KV of positions [n, c + k). The target verifies and keeps a
of the k drafts plus its own token: c' = c + 1 + a. The draft's KV is right where its input was a
kept token, i.e. for positions < min(c + k, c'): that is its new n, and draft blocks past the one
holding position n go back to the pool (the rule the target's table follows).
"""

from __future__ import annotations

from collections import Counter

from pagoda.contract.ids import RequestId
from pagoda.contract.step import ModelDraft
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core.request import SeqStatus, Sequence
from scheduler_svc.core.spec.ngram import Speculator
from scheduler_svc.core.step_draft import StepDraft

# What `draft` returns: only the count matters to the policy and to `schedule`; the tokens are the
# worker's draft model's, unknown until the step reports.
UNKNOWN_TOKEN = -1


class DraftModelSpeculator(Speculator):
    def stop_drafting(self, running: list[Sequence], after_step: int | None) -> None:
        """Over the batch limit the draft tables would hold blocks nobody uses, maybe for long:
        they go back now (the draft catches up in one forward when drafting resumes)."""
        for seq in running:
            if seq.draft_table:
                self._kv.release(seq.forget_draft(), after_step)

    def release_one(self, running: list[Sequence], step_id: int, after_step: int | None) -> bool:
        """The newest draft table not in plan `step_id` (its blocks are written by that step) goes
        back before a running sequence is preempted: the draft recomputes, the sequence does not."""
        for seq in reversed(running):
            if seq.draft_table and seq.draft_step != step_id:
                self._kv.release(seq.forget_draft(), after_step)
                return True
        return False

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        return [UNKNOWN_TOKEN] * limit  # the draft model proposes for every decoding sequence

    def schedule(self, draft: StepDraft, seq: Sequence, drafts: list[int], budget: int) -> int:
        """Blocks for the target's 1 + k positions and the draft's positions up to c + k, if both
        fit without preempting; the plan entry the worker's draft model follows."""
        if budget < 2:
            return 0
        k = min(len(drafts), budget - 1)
        num_new = 1 + k
        kv, bs, tenant = self._kv, self._kv.block_size, seq.request.tenant
        draft_needed = max(0, cdiv(seq.num_computed_tokens + k, bs) - len(seq.draft_table))
        if not kv.pool.can_allocate(kv.blocks_needed(seq, num_new) + draft_needed, tenant):
            return 0
        plan = draft.plan
        kv.grow(seq, num_new, plan)
        if draft_needed:
            new = kv.pool.allocate(draft_needed, tenant)
            assert new is not None, "checked by can_allocate"
            seq.draft_table.extend(new)
        start = seq.draft_synced
        plan.model_drafts.append(ModelDraft(seq.seq_id, k, seq.draft_num_computed, start,
                                            seq.draft_table[start:]))
        seq.draft_synced = len(seq.draft_table)
        seq.draft_step = plan.step_id
        plan.num_scheduled_tokens[seq.seq_id] = num_new
        draft.spec.append((seq, seq.generation, k))
        return num_new

    def settle(self, spec: list[tuple[Sequence, int, int]], request_ids: list[RequestId],
               after_step: int | None) -> None:
        super().settle(spec, request_ids, after_step)  # the target's table, the counters
        bs, gained = self._kv.block_size, Counter(request_ids)
        for seq, generation, k in spec:
            if seq.status is not SeqStatus.RUNNING or seq.generation != generation:
                continue  # finished or preempted since: its draft table is already released
            kept = seq.num_computed_tokens  # c' = c + 1 + a
            last = kept - gained[seq.seq_id]  # c = c' - (1 + a): the position of its last token then
            seq.draft_num_computed = min(last + k, kept)
            keep = seq.draft_num_computed // bs + 1
            table = seq.draft_table
            if len(table) > keep:
                self._kv.release(table[keep:], after_step)
                del table[keep:]
                seq.draft_synced = min(seq.draft_synced, keep)
