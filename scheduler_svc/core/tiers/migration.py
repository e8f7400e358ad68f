"""Live migration in the scheduler core: a request's KV leaves this replica (export) or arrives
from another (import), so its stream goes on elsewhere without recomputing its context.

Export, on the source (`Scheduler.export_request`): a running sequence is detached in the next
plan. The plan carries a `KvExport` of the blocks holding its computed tokens (at most its known
tokens: a placeholder's KV is of a token the caller never saw), and the request ends at once as an
abort does: its blocks take the usual deferred release, the worker drops it (finished ids), and a
token an in-flight step samples for it is discarded (the target samples it again: greedy and seeded
draws depend only on seed, sequence index and position). Its MIGRATED delta, carrying the
`KvHandoff`, is held until that plan's step reports: only then are the files there.
Why the order is safe: the worker runs the export first in its plan, after every earlier plan, so
the blocks hold every computed token (those of in-flight steps included, as a swap-out's do);
released blocks are reused only by this plan's later operations or by later plans.
A waiting request (queued, preempted, swapped) has no KV on the device: it ends at once with an
empty handoff (the target recomputes it, as a failover continuation); so does any request when the
worker cannot export (no --kv-migrate-dir, tensor parallel) or its window freed blocks.

Import, on the target: a continuation (prompt + streamed tokens) with `kv_import` resumes after the
imported tokens (swap.resume_point) at its first admission; the blocks past its prefix hit are loaded
from the files (`KvImport`, with the disk loads) instead of computed. Its last token is computed
once, as a decode (it samples the next token), so 0 prefill tokens are computed for it.

A worker loss or fail_all while a delta is held: the export may not have run, so the held deltas
go out with an empty handoff (reset) or are dropped with their failed requests (fail_all).
"""

from __future__ import annotations

from pagoda.contract.step import KvExport, KvImport, StepPlan
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.request import NULL_BLOCK, KvHandoff, Sequence


class Migrator:
    """The Scheduler holds one: exports asked and not yet planned, deltas held until their export's
    step reports, and the counters."""

    def __init__(self, block_size: int, enabled: bool, source: str = "") -> None:
        self._block_size = block_size
        self.enabled = enabled  # the worker exports and imports KV (its Init's kv_migration)
        self.source = source  # --kv-transfer grpc: the worker's KvTransfer address, in every handoff
        self.asked: dict[Sequence, str] = {}  # running sequence -> migration id, detached next plan
        self._held: dict[int, list[SequenceDelta]] = {}  # step id -> MIGRATED deltas it releases
        self.num_exported = 0  # requests whose KV left (with blocks)
        self.num_imported = 0
        self.blocks_exported = 0
        self.blocks_imported = 0

    def export(self, seq: Sequence, migration_id: str, plan: StepPlan) -> KvHandoff:
        """Add `seq`'s export to `plan` (before it is ended); its handoff (empty when its KV cannot go)."""
        bs = self._block_size
        num_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
        blocks = seq.block_table[:cdiv(num_tokens, bs)]
        if not (self.enabled and blocks) or NULL_BLOCK in blocks:
            return KvHandoff(migration_id, 0, 0)
        plan.kv_exports.append(KvExport(seq.seq_id, migration_id, list(blocks), num_tokens))
        self.num_exported += 1
        self.blocks_exported += len(blocks)
        return KvHandoff(migration_id, num_tokens, len(blocks), source=self.source)

    def hold(self, step_id: int, deltas: list[SequenceDelta]) -> None:
        self._held.setdefault(step_id, []).extend(deltas)

    def holds(self, step_id: int) -> bool:
        return step_id in self._held

    def reported(self, step_id: int) -> list[SequenceDelta]:
        """The MIGRATED deltas whose export ran in step `step_id`."""
        return self._held.pop(step_id, [])

    def load(self, seq: Sequence, num_hit: int, plan: StepPlan) -> None:
        """At `seq`'s first admission, its table allocated: load the imported blocks its prefix hit
        (`num_hit` tokens, device and tiers) does not cover; the handoff is then spent (a later
        resumption, after a preemption, recomputes as any other)."""
        req, bs = seq.request, self._block_size
        handoff = req.kv_import
        req.kv_import = None
        if handoff is None or not handoff.num_blocks:
            return
        first, end = num_hit // bs, min(handoff.num_blocks, cdiv(handoff.num_tokens, bs))
        if first >= end:
            return
        plan.kv_imports.append(KvImport(seq.seq_id, handoff.migration_id, first,
                                        list(seq.block_table[first:end]), handoff.num_tokens, handoff.snapshot))
        self.num_imported += 1
        self.blocks_imported += end - first

    def reset(self) -> list[SequenceDelta]:
        """The worker is gone: exports in flight may not have run. Their deltas, with an empty handoff."""
        deltas = [d for held in self._held.values() for d in held]
        self._held.clear()
        self.asked = {}  # (a new dict: the scheduler ends the old one's sequences)
        for delta in deltas:
            if delta.migration is not None:
                delta.migration = KvHandoff(delta.migration.migration_id, 0, 0)
        return deltas
