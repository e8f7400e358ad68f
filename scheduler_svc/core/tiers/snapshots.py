"""Session save in the scheduler core: a session lease's blocks written as a named snapshot, so the
session survives a worker restart or moves to another replica (docs/kv_tiers.md#session-save-and-restore).

Save (`Scheduler.save_session`): the lease's blocks (sessions.py: its history's full, registered
blocks, from the first) and their tokens go out in the next plan as a `KvExport` with `snapshot`
set, the first thing the worker does in that step (as a migration's export), into the worker's
--kv-snapshot-dir under `snapshot_name(salt, session id)`. Why the blocks hold what they say: they
are registered (every step that wrote them has reported) and full (no step writes them again), and
the lease holds a reference until the plan is built; a lease ended or demoted after the save was
asked lets its blocks go only to allocations of this plan or later ones, which the worker runs after
the export. The save completes when that step reports (`take_done`), or fails with the worker
(`reset`: the export may not have run).

Restore is not here: it is a one-token request whose prompt is the snapshot's tokens and whose
`kv_import` names the snapshot (migration.py loads the blocks its prefix hit lacks, at admission);
when it finishes, its session id leases the blocks again (sessions.py). The engine loop builds it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.step import KvExport, StepPlan
from scheduler_svc.core.prefix_index import PrefixIndex
from scheduler_svc.core.tiers.sessions import Lease, session_key


def _still_cached(demoted: list[tuple[BlockId, int]], index: PrefixIndex) -> list[BlockId]:
    """The leading blocks a demoted lease let go that still hold its tokens: registered under the
    serial they had (a block evicted and reused is registered anew, under a new serial)."""
    blocks: list[BlockId] = []
    for block, serial in demoted:
        if not index.is_cached(block) or index.serial_of(block) != serial:
            break
        blocks.append(block)
    return blocks


def snapshot_name(cache_salt: str | None, session_id: str) -> str:
    """The snapshot's folder name: a digest of the tenant's salt and the session id, so any id is a
    safe file name and one tenant never reaches another's snapshot."""
    return hashlib.sha256(session_key(cache_salt, session_id).encode()).hexdigest()[:32]


@dataclass(slots=True, eq=False)
class SessionSave:
    session_id: str
    name: str
    num_tokens: int
    num_blocks: int
    ok: bool = True  # False: the worker was lost before its step reported


class SessionSaves:
    """The Scheduler holds one: saves asked and not planned yet, saves in flight by step id, done."""

    def __init__(self, block_size: int, enabled: bool) -> None:
        self._block_size = block_size
        self.enabled = enabled  # the worker has a snapshot folder (its Init's kv_snapshot_dir)
        self._asked: list[tuple[SessionSave, list[BlockId], tuple[int, ...]]] = []
        self._held: dict[int, list[SessionSave]] = {}
        self._done: list[SessionSave] = []
        self.num_saved = 0
        self.blocks_saved = 0

    def ask(self, lease: Lease, session_id: str, name: str, index: PrefixIndex) -> SessionSave:
        """InvalidRequestError when this worker cannot save, or the lease holds nothing to save. A
        lease demoted under pressure saves the leading blocks it let go that are still cached."""
        if not self.enabled:
            raise InvalidRequestError("no session snapshot folder: start the worker with --kv-snapshot-dir")
        blocks = lease.blocks or _still_cached(lease.demoted, index)
        if blocks and not lease.token_ids:
            raise InvalidRequestError(f"session {session_id!r} cannot be saved: it runs under a LoRA adapter "
                                      "or a sliding window freed its first blocks")
        if not blocks:
            raise InvalidRequestError(f"session {session_id!r} holds no cached blocks now (its history is "
                                      "shorter than a block, or other traffic evicted them): save it after "
                                      "its next turn")
        tokens = lease.token_ids[:len(blocks) * self._block_size]
        save = SessionSave(session_id, name, len(tokens), len(blocks))
        self._asked.append((save, list(blocks), tokens))
        return save

    def plan(self, plan: StepPlan) -> None:
        """At the start of a plan: its exports run before anything in it reuses a block."""
        if not self._asked:
            return
        for save, blocks, tokens in self._asked:
            plan.kv_exports.append(KvExport(RequestId(""), save.name, blocks, len(tokens), snapshot=True,
                                            token_ids=tokens))
        self._held.setdefault(plan.step_id, []).extend(save for save, _, _ in self._asked)
        self._asked = []

    def reported(self, step_id: int) -> None:
        for save in self._held.pop(step_id, ()):
            self._done.append(save)
            self.num_saved += 1
            self.blocks_saved += save.num_blocks

    def take_done(self) -> list[SessionSave]:
        done, self._done = self._done, []
        return done

    def reset(self) -> None:
        """The worker is gone: saves not reported may not have run (failed, ok False)."""
        lost = [save for save, _, _ in self._asked] + [s for held in self._held.values() for s in held]
        self._asked, self._held = [], {}
        for save in lost:
            save.ok = False
        self._done += lost
