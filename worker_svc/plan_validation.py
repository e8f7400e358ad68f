"""Checks that a step plan applies cleanly to the worker's resident state, before anything changes.

Pure bookkeeping over lengths and ids (no tensors), so a rejected plan costs nothing to undo.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pagoda.contract.errors import PlanError
from pagoda.contract.ids import RequestId
from pagoda.contract.step import NewRequestData, StepPlan
from worker_svc.input_batch import CachedRequestState


def validate_plan(plan: StepPlan, resident: Mapping[RequestId, CachedRequestState], num_blocks: int,
                  block_size: int, num_cpu_blocks: int = 0, has_disk_tier: bool = False) -> None:
    if plan.beam_updates:  # applied first: the rest of the plan sees the re-pointed beams
        resident = _after_beam_updates(plan, resident)
    dropped = _check_dropped(plan, resident)
    new = _check_new_requests(plan.new_requests, resident, dropped, num_blocks)

    def is_live(request_id: RequestId) -> bool:
        return request_id in new or (request_id in resident and request_id not in dropped)

    table_lens = _check_table_updates(plan, resident, new, is_live, num_blocks)
    for request_id, count in plan.num_scheduled_tokens.items():
        if request_id not in resident or request_id in dropped:
            raise PlanError(f"num_scheduled_tokens names {request_id!r}, which is not resident")
        if count < 0:
            raise PlanError(f"negative token count {count} for {request_id!r}")
    for request_id in plan.draft_token_ids:
        if request_id not in resident or request_id in dropped:
            raise PlanError(f"draft tokens for {request_id!r}, which is not resident")
    samples = _check_capacity(plan, resident, new, dropped, table_lens, block_size)
    _check_forks(plan, is_live, samples)
    for copy in plan.block_copies:
        _check_blocks((copy.src, copy.dst), num_blocks, "block copy")
    _check_swaps(plan, num_blocks, num_cpu_blocks)
    _check_disk(plan, num_blocks, num_cpu_blocks, has_disk_tier)


def _check_swaps(plan: StepPlan, num_blocks: int, num_cpu_blocks: int) -> None:
    """Ids in range on each side, and no block written twice by one plan's swaps."""
    for name, copies, src_blocks, dst_blocks in (("swap-out", plan.swap_out, num_blocks, num_cpu_blocks),
                                                 ("swap-in", plan.swap_in, num_cpu_blocks, num_blocks)):
        if copies and not num_cpu_blocks:
            raise PlanError(f"a {name} but this worker has no host pool (start it with --swap-space "
                            "or --kv-offloading-size)")
        _check_blocks((c.src for c in copies), src_blocks, f"{name} source")
        _check_blocks((c.dst for c in copies), dst_blocks, f"{name} destination")
        if len({c.dst for c in copies}) != len(copies):
            raise PlanError(f"a {name} writes one block twice: {[c.dst for c in copies]}")


def _check_disk(plan: StepPlan, num_blocks: int, num_cpu_blocks: int, has_disk_tier: bool) -> None:
    """Disk tier operations only with --kv-offload-dir; ids in range; no device block written by
    both a disk load and a swap-in, nor twice."""
    if not (plan.disk_deletes or plan.disk_writes or plan.disk_loads):
        return
    if not has_disk_tier:
        raise PlanError("a disk tier operation but this worker has no disk tier (start it with --kv-offload-dir)")
    _check_blocks((w.src for w in plan.disk_writes if not w.from_device), num_cpu_blocks, "disk write source")
    _check_blocks((w.src for w in plan.disk_writes if w.from_device), num_blocks, "disk write source")
    _check_blocks((d.dst for d in plan.disk_loads), num_blocks, "disk load destination")
    written = [d.dst for d in plan.disk_loads] + [c.dst for c in plan.swap_in]
    if len(set(written)) != len(written):
        raise PlanError(f"disk loads and swap-ins write one device block twice: {written}")


def _check_dropped(plan: StepPlan, resident: Mapping[RequestId, CachedRequestState]) -> set[RequestId]:
    dropped: set[RequestId] = set()
    for request_id in (*plan.finished_ids, *plan.preempted_ids):
        if request_id not in resident:
            raise PlanError(f"cannot drop {request_id!r}: not resident")
        if request_id in dropped:
            raise PlanError(f"{request_id!r} is dropped twice in one plan")
        dropped.add(request_id)
    return dropped


def _after_beam_updates(plan: StepPlan, resident: Mapping[RequestId, CachedRequestState]
                        ) -> dict[RequestId, CachedRequestState]:
    """The resident view the rest of the plan sees: each updated beam has its parent's lengths."""
    view = dict(resident)
    targets: set[RequestId] = set()
    for update in plan.beam_updates:
        parent = resident.get(update.parent_id)
        if parent is None:
            raise PlanError(f"beam update from {update.parent_id!r}, which is not resident")
        if parent.num_computed_tokens != len(parent.token_ids) - 1:
            raise PlanError(f"beam update from {update.parent_id!r}, which has not just sampled")
        if update.request_id in targets:
            raise PlanError(f"beam {update.request_id!r} is updated twice in one plan")
        targets.add(update.request_id)
        view[update.request_id] = parent
    return view


def _check_new_requests(new_requests: list[NewRequestData],
                        resident: Mapping[RequestId, CachedRequestState], dropped: set[RequestId],
                        num_blocks: int) -> dict[RequestId, NewRequestData]:
    new: dict[RequestId, NewRequestData] = {}
    for req in new_requests:
        rid = req.request_id
        if rid in new or (rid in resident and rid not in dropped):
            raise PlanError(f"new request {rid!r} is already resident")
        if not 0 < req.num_prompt_tokens <= len(req.token_ids):
            raise PlanError(f"{rid!r}: num_prompt_tokens {req.num_prompt_tokens} out of range")
        if req.num_computed_tokens < 0 or req.num_scheduled_tokens < 1:
            raise PlanError(f"{rid!r}: a new request computes at least one token from >= 0")
        _check_blocks(req.block_ids, num_blocks, f"new request {rid!r}")
        new[rid] = req
    return new


def _check_table_updates(plan: StepPlan, resident: Mapping[RequestId, CachedRequestState],
                         new: Mapping[RequestId, NewRequestData], is_live, num_blocks: int
                         ) -> dict[RequestId, int]:
    """Return the table length after the updates of every request the plan updates."""
    lens: dict[RequestId, int] = {}
    for update in plan.table_updates:
        rid = update.request_id
        if not is_live(rid):
            raise PlanError(f"table update for {rid!r}, which is not resident")
        current = lens.get(rid)
        if current is None:
            current = len(new[rid].block_ids) if rid in new else len(resident[rid].block_ids)
        if not 0 <= update.start <= current:
            raise PlanError(f"table update for {rid!r} starts at {update.start}, table has {current}")
        _check_blocks(update.block_ids, num_blocks, f"table update for {rid!r}")
        lens[rid] = max(current, update.start + len(update.block_ids))
    return lens


def _check_capacity(plan: StepPlan, resident: Mapping[RequestId, CachedRequestState],
                    new: Mapping[RequestId, NewRequestData], dropped: set[RequestId],
                    table_lens: Mapping[RequestId, int], block_size: int) -> set[RequestId]:
    """Every scheduled count fits the tokens left and the table; return the ids that sample."""
    samples: set[RequestId] = set()
    drafts = plan.draft_token_ids  # computed after the request's own tokens
    model_drafts = {d.request_id: d.num_drafts for d in plan.model_drafts}  # proposed by the worker
    entries = [(rid, len(s.token_ids) + len(drafts.get(rid, ())) + model_drafts.get(rid, 0),
                s.num_computed_tokens, len(s.block_ids),
                plan.num_scheduled_tokens.get(rid, 1))
               for rid, s in resident.items() if rid not in dropped]
    entries += [(rid, len(r.token_ids), r.num_computed_tokens, len(r.block_ids), r.num_scheduled_tokens)
                for rid, r in new.items()]
    for rid, num_tokens, computed, table_len, count in entries:
        if count == 0:
            continue
        end = computed + count
        if end > num_tokens:
            raise PlanError(f"{rid!r}: {count} tokens scheduled, only {num_tokens - computed} left")
        capacity = table_lens.get(rid, table_len) * block_size
        if end > capacity:
            raise PlanError(f"{rid!r}: tokens up to {end} do not fit its {capacity}-slot table")
        if end == num_tokens:
            samples.add(rid)
    return samples


def _check_forks(plan: StepPlan, is_live, samples: set[RequestId]) -> None:
    children: set[RequestId] = set()
    for fork in plan.forks:
        if not is_live(fork.parent_id):
            raise PlanError(f"fork of {fork.parent_id!r}, which is not resident")
        if fork.parent_id not in samples:
            raise PlanError(f"fork of {fork.parent_id!r}, which does not sample this step")
        for child in fork.child_ids:
            if child in children or is_live(child):
                raise PlanError(f"fork child {child!r} already exists")
            children.add(child)


def _check_blocks(block_ids: Iterable[int], num_blocks: int, where: str) -> None:
    for block in block_ids:
        if not 0 <= block < num_blocks:
            raise PlanError(f"{where}: block id {block} out of range [0, {num_blocks})")
