"""Session save / restore in the scheduler core (scheduler_svc/core/tiers/snapshots.py): a save puts
the lease's blocks and tokens in the next plan as a snapshot export, done when that step reports;
a restore is a one-token request whose kv_import names the snapshot, loading the blocks its prefix
hit lacks, after which the session's lease holds them and its next turn hits them. Exact block ids;
the fake worker checks that a save's blocks hold the tokens it names and that every attended slot
holds the right token (so a restore into the wrong blocks fails)."""

from __future__ import annotations

import pytest

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import KvExport, KvImport
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from scheduler_svc.core.request import KvHandoff
from scheduler_svc.core.tiers.snapshots import snapshot_name
from tests.unit.test_sessions import Clock, req, run
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

NAME = snapshot_name(None, "s")


def replica(files: dict, kv_snapshots: bool = True, num_blocks: int = 8):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=2, max_model_len=64, eos_token_ids=(0,),
                          max_inflight_steps=1, kv_snapshots=kv_snapshots)
    return Scheduler(cfg, clock=Clock()), FakeWorker(num_blocks, 2, FakeSampler(vocab_size=50), migrations=files)


def saved_first_turn():
    files: dict = {}
    sched, worker = replica(files)
    run(sched, worker, req("a", [1, 2, 3, 4, 5], max_tokens=2, session="s"))
    history = [1, 2, 3, 4, 5, *worker.sampled["a"]]
    save = sched.save_session(None, "s", NAME)
    assert (save.num_tokens, save.num_blocks) == (6, 3) and sched.take_saved_sessions() == []
    plan = sched.schedule()  # a plan for the save alone (and a's finish)
    assert plan.kv_exports == [KvExport(RequestId(""), NAME, [0, 1, 2], 6, snapshot=True,
                                        token_ids=tuple(history[:6]))]
    sched.update(worker.execute(plan))
    assert sched.take_saved_sessions() == [save] and save.ok
    sched.check_invariants()
    return files, history


def restore(sched, worker, rid="r"):
    return run(sched, worker, EngineRequest(
        RequestId(rid), tuple(saved_tokens), SamplingParams(max_tokens=1), session_id="s", session_ttl=10.0,
        kv_import=KvHandoff(NAME, len(saved_tokens), 3, snapshot=True)))


saved_tokens: list[int] = []


def test_a_saved_session_restores_on_another_replica_and_its_next_turn_hits_it():
    files, history = saved_first_turn()
    saved_tokens[:] = history[:6]
    sched, worker = replica(files)  # another replica (or a restarted one): an empty pool
    plans = restore(sched, worker)
    new = plans[0][0].new_requests[0]
    assert (new.block_ids, new.num_computed_tokens, new.num_scheduled_tokens) == ([0, 1, 2], 5, 1)
    assert plans[0][0].kv_imports == [KvImport(RequestId("r"), NAME, 0, [0, 1, 2], 6, snapshot=True)]
    assert sched.stats().prefill_tokens_computed == 1  # only the last token, which samples
    assert (sched.num_sessions, sched.num_session_blocks) == (1, 3)
    assert NAME in files  # a snapshot stays: it may be restored again

    plans = run(sched, worker, req("b", history + [7, 8], session="s"))
    new = plans[0][0].new_requests[0]
    assert new.block_ids[:3] == [0, 1, 2] and new.num_computed_tokens == 6
    assert plans[-1][1][0].num_cached_tokens == 6


def test_a_restore_loads_only_what_the_prefix_cache_lacks():
    files, history = saved_first_turn()
    saved_tokens[:] = history[:6]
    sched, worker = replica(files)
    run(sched, worker, req("p", history[:2] + [9], max_tokens=1))  # caches block 0 = history[:2]
    plans = restore(sched, worker)
    (load,) = plans[0][0].kv_imports
    assert (load.first_block, load.block_ids) == (1, plans[0][0].new_requests[0].block_ids[1:3])
    assert plans[-1][1][0].num_cached_tokens == 2


def test_save_needs_a_snapshot_folder_a_lease_and_a_live_worker():
    sched, worker = replica({}, kv_snapshots=False)
    assert sched.save_session(None, "nobody", NAME) is None
    run(sched, worker, req("a", [1, 2, 3, 4, 5], max_tokens=2, session="s"))
    with pytest.raises(InvalidRequestError, match="--kv-snapshot-dir"):
        sched.save_session(None, "s", NAME)
    assert sched.save_session("other-tenant", "s", NAME) is None  # a tenant reaches only its own

    sched, worker = replica({})
    run(sched, worker, req("a", [1, 2, 3, 4, 5], max_tokens=2, session="s"))
    save = sched.save_session(None, "s", NAME)
    plan = sched.schedule()
    assert plan.kv_exports
    sched.reset_after_worker_loss()  # the export may not have run
    assert sched.take_saved_sessions() == [save] and not save.ok
    assert snapshot_name("t1", "s") != snapshot_name("t2", "s") != NAME


def test_a_demoted_lease_saves_its_leading_blocks_still_cached():
    files: dict = {}
    sched, worker = replica(files, num_blocks=6)
    run(sched, worker, req("a", [1, 2, 3, 4, 5], max_tokens=2, session="s"))
    history = [1, 2, 3, 4, 5, *worker.sampled["a"]]
    # 4 blocks needed, 3 free: the lease lets go of 0, 1, 2, and block 2 (evicted first) is reused.
    plans = run(sched, worker, req("b", [20, 21, 22, 23, 24, 25, 26]))
    assert plans[0][0].new_requests[0].block_ids == [3, 4, 5, 2] and sched.num_session_blocks == 0
    save = sched.save_session(None, "s", NAME)
    assert (save.num_tokens, save.num_blocks) == (4, 2)
    plan = sched.schedule()
    assert plan.kv_exports == [KvExport(RequestId(""), NAME, [0, 1], 4, snapshot=True, token_ids=tuple(history[:4]))]
    sched.update(worker.execute(plan))  # the fake worker checks blocks 0, 1 still hold those tokens
    assert sched.take_saved_sessions() == [save]
    run(sched, worker, req("c", [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]))  # evicts 0 and 1 too
    with pytest.raises(InvalidRequestError, match="no cached blocks"):
        sched.save_session(None, "s", NAME)
