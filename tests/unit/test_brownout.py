"""Brownout (scheduler_svc/core/brownout.py): the pure decision on a step clock, then a cramped pool
under a burst, driven through the scheduler core and the fake worker, with and without it."""

from __future__ import annotations

import random

import pytest

from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from scheduler_svc.core import EngineRequest
from scheduler_svc.core.brownout import Brownout, BrownoutConfig
from tests.unit.test_fake_worker_property import expected
from tests.unit.test_poison_isolation import Run, config, greedy

CFG = BrownoutConfig(max_tokens=8, kv_watermark=0.9, kv_recover_watermark=0.5, preemption_threshold=4,
                     window_steps=8)


def feed(brownout: Brownout, observations) -> list:
    """observations: (kv_usage, preemption total) per step; the transitions, as (step, active, reason)."""
    out = []
    for kv, total in observations:
        if (change := brownout.observe(kv, total)) is not None:
            out.append((change.step, change.active, change.reason))
    return out


def test_sustained_kv_usage_enters_a_short_spike_does_not() -> None:
    assert feed(Brownout(CFG), [(0.95, 0)] * 7 + [(0.2, 0)] + [(0.95, 0)] * 7) == []
    assert feed(Brownout(CFG), [(0.95, 0)] * 8) == [(8, True, "kv_usage")]


def test_preemptions_within_the_window_enter_older_ones_do_not_count() -> None:
    # 3 preemptions at step 1, then one more at step 9: the first three left the 8-step window
    spread = [(0.5, 3)] + [(0.5, 3)] * 7 + [(0.5, 4)]
    assert feed(Brownout(CFG), spread) == []
    assert feed(Brownout(CFG), [(0.5, 3)] + [(0.5, 3)] * 6 + [(0.5, 4)]) == [(8, True, "preemptions")]


def test_leaving_needs_a_calm_window_and_a_preemption_restarts_it() -> None:
    b = Brownout(CFG)
    enter = [(0.95, 0)] * 8
    calm_then_preempt = [(0.3, 0)] * 7 + [(0.3, 1)]  # the 8th calm step preempts: not calm
    middle = [(0.6, 1)] * 8  # below the entry mark but above the recovery mark: stays
    assert feed(b, enter + calm_then_preempt + middle + [(0.3, 1)] * 8) == [
        (8, True, "kv_usage"), (32, False, "recovered")]


def test_off_signals_and_rebase_and_idle() -> None:
    kv_only = BrownoutConfig(kv_watermark=0.9, kv_recover_watermark=0.5, preemption_threshold=0, window_steps=4)
    assert feed(Brownout(kv_only), [(0.5, n * 10) for n in range(20)]) == []
    no_kv = BrownoutConfig(kv_watermark=1.01, kv_recover_watermark=0.5, window_steps=4)
    assert feed(Brownout(no_kv), [(1.0, 0)] * 20) == []
    b = Brownout(CFG)
    b.rebase(100)  # a worker loss preempted 100 sequences: not pressure
    assert feed(b, [(0.5, 100)] * 4) == []
    assert b.leave_idle() is None
    feed(b, [(0.95, 100)] * 8)
    assert b.active and b.leave_idle().reason == "idle" and not b.active


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(kv_recover_watermark=0.99),
                                 dict(kv_recover_watermark=0.0), dict(window_steps=0),
                                 dict(preemption_threshold=-1), dict(max_num_batched_tokens=0)])
def test_bad_configs_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        BrownoutConfig(**bad)


def test_default_step_budget_is_half_but_not_below_max_num_seqs() -> None:
    assert BrownoutConfig().step_budget(2048, 256) == 1024
    assert BrownoutConfig().step_budget(300, 256) == 256
    assert BrownoutConfig().step_budget(64, 256) == 64
    assert BrownoutConfig(max_num_batched_tokens=100).step_budget(2048, 256) == 100


# -- through the scheduler core + fake worker -------------------------------------------------------

def burst_run(brownout: BrownoutConfig | None) -> tuple[Run, list, list[EngineRequest]]:
    """48 requests in 6 steps into a 32-block pool (a quarter of what they would need), then a
    trickle of 12 short ones: pressure, then calm. Invariants are checked after every step."""
    rng = random.Random(1)
    burst = [greedy(f"b{i}", [1 + rng.randrange(30) for _ in range(rng.randrange(4, 12))], rng.randrange(24, 48))
             for i in range(48)]
    trickle = [greedy(f"t{k}", [3, 4, 5, 6], 12) for k in range(12)]
    run = Run(config(num_blocks=32, max_num_seqs=16, brownout=brownout), lambda plan, result: False)
    changes, budgets, schedule = [], [], run.scheduler.schedule

    def observed_schedule():  # what the engine loop does after each schedule(): take the transitions
        plan = schedule()
        changes.extend(run.scheduler.brownout_changes)
        run.scheduler.brownout_changes.clear()
        if plan is not None:
            budgets.append((run.scheduler.brownout_active, sum(
                plan.num_scheduled_tokens.get(r, 1) for r in _computed_ids(plan, run.scheduler))))
        return plan

    run.scheduler.schedule = observed_schedule
    run.go([(i // 8, r) for i, r in enumerate(burst)] + [(200 + 25 * k, r) for k, r in enumerate(trickle)])
    run.budgets = budgets
    return run, changes, burst + trickle


def _computed_ids(plan, scheduler) -> list:
    return [seq.seq_id for seq in scheduler._queues.running if plan.num_scheduled_tokens.get(seq.seq_id, 1)]


def test_a_burst_on_a_cramped_pool_browns_out_preempts_less_and_loses_nothing() -> None:
    plain, plain_changes, requests = burst_run(None)
    brown, changes, _ = burst_run(CFG)
    without, with_ = plain.scheduler.stats(), brown.scheduler.stats()
    print(f"\nbrownout burst (core + fake worker): preemptions without {without.num_preemptions}, "
          f"with {with_.num_preemptions}; steps {len(plain.steps)} vs {len(brown.steps)}; "
          f"capped {with_.brownout_capped_requests}; transitions "
          f"{[(c.step, c.active, c.reason) for c in changes]}")
    assert plain_changes == [] and without.brownout_entries == 0
    assert [c.active for c in changes] == [True, False] and changes[-1].reason == "recovered"
    assert with_.brownout_entries == 1 and not with_.brownout_active
    assert with_.num_preemptions * 2 < without.num_preemptions
    for run in (plain, brown):  # every request ended exactly once (Run.record asserts "once")
        assert len(run.ended) == len(requests) and set(run.ended.values()) == {FinishReason.LENGTH}
        assert run.scheduler.stats().num_used_blocks == 0
    capped = 0
    for request in requests:  # the same tokens; a capped request's are a prefix of 8
        key = (request.request_id, 0)
        full = expected(brown.sampler, request, 0)
        assert plain.streams[key] == full
        got = brown.streams[key]
        assert got == full[:len(got)] and len(got) in (len(full), CFG.max_tokens)
        capped += len(got) < len(full)
    assert capped == with_.brownout_capped_requests > 0
    assert all(request.request_id.startswith("b") for request in requests
               if len(brown.streams[(request.request_id, 0)]) < request.sampling.max_tokens)
    budget = CFG.step_budget(64, 16)
    assert max(tokens for active, tokens in brown.budgets if active) <= budget < 64


def test_only_first_admissions_are_capped_and_the_worker_sees_the_cap() -> None:
    run = Run(config(num_blocks=64, brownout=CFG), lambda plan, result: False)
    early = greedy("early", [1, 2, 3], 30)
    run.scheduler.add_request(early)
    run.scheduler.update(run.worker.execute(run.scheduler.schedule()))
    run.scheduler._brownout.apply(run.scheduler._brownout.decider._change(True, "kv_usage", 0.95))
    late = EngineRequest(RequestId("late"), (4, 5, 6), SamplingParams(max_tokens=30, min_tokens=10,
                                                                       ignore_eos=True))
    tiny = greedy("tiny", [7, 8], 3)
    run.scheduler.add_request(late)
    run.scheduler.add_request(tiny)
    plan = run.scheduler.schedule()
    sent = {new.request_id: new.sampling.max_tokens for new in plan.new_requests}
    assert sent == {"late": 10, "tiny": 3}  # never below min_tokens; a short request is left alone
    assert run.scheduler._queues.requests["early"].max_tokens == 30
    assert run.scheduler.stats().brownout_capped_requests == 1


def test_a_worker_loss_is_not_memory_pressure() -> None:
    run = Run(config(num_blocks=64, brownout=BrownoutConfig(preemption_threshold=2, window_steps=4)),
              lambda plan, result: False)
    for i in range(10):
        run.scheduler.add_request(greedy(f"r{i}", [1, 2, 3], 8))
    run.scheduler.update(run.worker.execute(run.scheduler.schedule()))
    run.scheduler.reset_after_worker_loss()  # preempts all 10
    assert run.scheduler.stats().num_preemptions == 10
    run.worker = type(run.worker)(64, 4, run.sampler)
    run.go([(0, greedy("after", [5, 6], 4))])
    assert not run.scheduler.brownout_changes and run.scheduler.stats().brownout_entries == 0


def test_scheduler_flags_build_the_config_and_refuse_bad_values() -> None:
    from scheduler_svc.__main__ import build_config, parse_args
    assert build_config(parse_args([])).brownout is None  # off by default
    on = build_config(parse_args(["--enable-brownout", "--brownout-max-tokens", "64",
                                  "--brownout-preemptions", "0", "--brownout-window-steps", "16"])).brownout
    assert on == BrownoutConfig(max_tokens=64, preemption_threshold=0, window_steps=16)
    with pytest.raises(SystemExit, match="kv_recover_watermark"):
        build_config(parse_args(["--enable-brownout", "--brownout-kv-recover-watermark", "0.99"]))
