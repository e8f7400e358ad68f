"""benchmarks/sessions_sim.py: the sessions workload through the scheduler core and the fake worker in
modelled time: what a step is charged for, and the clock of the closed loop."""

from __future__ import annotations

from benchmarks.sessions import parse_args, plan_sessions
from benchmarks.sessions_sim import StepCost, replay, scheduler_config, think_times
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

ONE_SECOND_STEPS = StepCost(a=1.0, b=0.0, c=0.0, d=0.0, e=0.0, f=0.0)


def test_a_step_is_charged_for_its_chunks_attention_rows_and_copies():
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, eos_token_ids=(0,),
                          max_num_batched_tokens=16, long_prefill_token_threshold=8, max_inflight_steps=1)
    sched, worker = Scheduler(cfg), FakeWorker(16, 4, FakeSampler(vocab_size=50))
    sched.add_request(EngineRequest(RequestId("a"), tuple(range(1, 13)), SamplingParams(max_tokens=4)))
    sched.add_request(EngineRequest(RequestId("b"), tuple(range(20, 24)), SamplingParams(max_tokens=4)))
    cost = StepCost()
    plan = sched.schedule()  # a's first chunk of 8, b's 4 tokens
    assert cost.features(plan, worker) == (1, 12, (8 * 4 + 4 * 2) / 1e6, 0, 0.0, 0)
    sched.update(worker.execute(plan))
    plan = sched.schedule()  # a's last 4 after its 8, b's decode row at context 4
    assert cost.features(plan, worker) == (1, 4, 4 * (8 + 2) / 1e6, 1, 4 / 1e3, 0)
    assert cost.seconds(cost.features(plan, worker)) == cost.a + 4 * cost.b + 40e-6 * cost.c + cost.d + 4e-3 * cost.e


def test_the_clock_of_the_closed_loop_with_one_second_steps():
    """Two sessions of two turns, no think time: both first turns prefill in step 1 (first token at
    1 s), each turn's 2 tokens take one more step, and the next turn is sent at once: no idle time,
    so the run lasts as many seconds as it has steps (the last plan, made while step 4 ran, only
    drops the finished turns: it computes nothing and costs nothing)."""
    args = parse_args(["--sessions", "2", "--turns", "2", "--first-len", "32", "--message-len", "8:8",
                       "--output-len", "2", "--think-time", "0"])
    sessions = plan_sessions(args)
    run = replay(sessions, think_times(args), scheduler_config(args, sessions, "tier", "fcfs"),
                 ONE_SECOND_STEPS, args.output_len)
    assert [row[:2] + row[3:] for row in run["requests"]] == [  # session, turn, TTFT, decode
        [0, 1, 1.0, 1.0], [0, 2, 1.0, 1.0], [1, 1, 1.0, 1.0], [1, 2, 1.0, 1.0]]
    assert run["duration_s"] == run["features"]["steps"] == 4
