"""Poison isolation in the scheduler core (core/poison.py), driven through the fake worker.

A step that samples for a poisoned request fails as the worker reports it (results of earlier steps
arrive first, then the failure; the worker's state is gone). The poisoned request must end with
ERROR after exactly one batched and one solo failure, every other sequence must produce exactly
what the deterministic fake sampler gives it, and the block accounting must hold after every step.
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from tests.unit.test_fake_worker_property import EOS, expected, traces
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


class Run:
    """Drive scheduler + fake worker; `fails(plan, result)` says whether the worker fails a step."""

    def __init__(self, config: SchedulerConfig, fails, eos_probability: float = 0.0) -> None:
        self.config, self.fails = config, fails
        self.sampler = FakeSampler(vocab_size=40, eos_token_id=EOS, eos_probability=eos_probability)
        self.scheduler = Scheduler(config)
        self.worker = FakeWorker(config.num_blocks, config.block_size, self.sampler,
                                 num_cpu_blocks=config.num_cpu_blocks + config.num_offload_blocks)
        self.streams: dict[tuple[str, int], list[int]] = {}
        self.ended: dict[tuple[str, int], FinishReason] = {}
        self.errors: dict[str, str] = {}
        self.cached_tokens: dict[str, int] = {}  # prompt tokens served from the prefix cache
        self.failures = 0
        self.steps = []  # (plan, result, failed) in the order sent

    def record(self, deltas) -> None:
        for delta in deltas:
            if delta.request_id.startswith("__pin__/"):  # internal (pinning.py): re-run after a loss
                continue
            key = (delta.request_id, delta.seq_index)
            assert key not in self.ended, f"{key} got a delta after it ended"
            self.streams.setdefault(key, []).extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                self.ended[key] = delta.finish_reason
            if delta.error is not None:
                self.errors[delta.request_id] = delta.error
            self.cached_tokens[delta.request_id] = delta.num_cached_tokens

    def go(self, arrivals: list[tuple[int, EngineRequest]], aborts=(), max_steps: int = 3000) -> None:
        scheduler, pending = self.scheduler, deque()
        for step in range(max_steps):
            for at, request in arrivals:
                if at == step:
                    scheduler.add_request(request)
            for at, request_id in aborts:
                if at == step:
                    self.record(scheduler.abort(request_id))
            scheduler.check_invariants()
            if step > max(at for at, _ in arrivals) and not scheduler.has_unfinished_requests() \
                    and not pending:
                for _, request in arrivals:  # what session leases still pin goes back to the pool
                    if request.session_id is not None:
                        scheduler.end_session(request.cache_salt, request.session_id)
                return
            plan = scheduler.schedule()
            if plan is not None:
                result = self.worker.execute(plan)
                failed = self.fails(plan, result)
                self.steps.append((plan, result, failed))
                if failed:  # the results before it arrive, then the failure; the state is lost
                    while pending:
                        self.record(scheduler.update(pending.popleft()))
                    self.failures += 1
                    self.record(scheduler.note_step_failure(plan.step_id, "boom"))
                    scheduler.reset_after_worker_loss()
                    self.worker = FakeWorker(
                        self.config.num_blocks, self.config.block_size, self.sampler,
                        num_cpu_blocks=self.config.num_cpu_blocks + self.config.num_offload_blocks)
                    continue
                pending.append(result)
            if pending and (plan is None or len(pending) >= self.config.max_inflight_steps):
                self.record(scheduler.update(pending.popleft()))
        raise AssertionError("the run did not finish: a failing step loops")


def samples_for(request_id: str):
    return lambda plan, result: any(rid.split("#")[0] == request_id for rid in result.request_ids)


def config(**overrides) -> SchedulerConfig:
    base = dict(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=32,
                max_num_batched_tokens=64, eos_token_ids=(EOS,))
    return SchedulerConfig(**{**base, **overrides})


def greedy(rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> EngineRequest:
    return EngineRequest(RequestId(rid), tuple(prompt),
                         SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, ignore_eos=True))


def test_the_poisoned_request_fails_alone_and_16_others_are_exact() -> None:
    requests = [greedy(f"ok{i}", [1 + i % 5, 2, 3 + i % 3], 12) for i in range(16)]
    poison = greedy("poison", [4, 4, 4], 12)
    run = Run(config(), samples_for("poison"))
    run.go([(0, r) for r in requests[:8]] + [(3, poison)] + [(5, r) for r in requests[8:]])
    assert run.failures == 2  # once batched, once alone: then convicted
    assert run.ended[("poison", 0)] is FinishReason.ERROR and "boom" in run.errors["poison"]
    for request in requests:
        key = (request.request_id, 0)
        assert run.ended[key] is FinishReason.LENGTH
        assert run.streams[key] == expected(run.sampler, request, 0)
    stats = run.scheduler.stats()
    assert (stats.num_step_failures, stats.num_requests_isolated, stats.num_used_blocks) == (2, 1, 0)


def test_after_a_failure_each_suspect_runs_alone_until_it_samples_then_batching_resumes() -> None:
    requests = [greedy(f"r{i}", [1, 2, 3, 4, 5, 6], 8) for i in range(3)]
    failed_once = []

    def transient(plan, result):  # the third step fails once, whoever is in it
        if plan.step_id == 3 and not failed_once:
            failed_once.append(plan.step_id)
            return True
        return False

    run = Run(config(max_inflight_steps=1), transient)
    run.go([(0, r) for r in requests])
    after = [set(result.request_ids) for _, result, _ in run.steps[3:]]  # who sampled
    assert after[:3] == [{"r0"}, {"r1"}, {"r2"}], after[:4]  # one suspect per step, in order
    assert after[3] == {"r0", "r1", "r2"}  # cleared: batched again
    assert not run.errors and run.failures == 1
    for request in requests:  # a transient failure costs nobody a token
        assert run.streams[(request.request_id, 0)] == expected(run.sampler, request, 0)


def test_a_worker_that_fails_every_step_fails_every_request_within_the_budget() -> None:
    requests = [greedy(f"r{i}", [i + 1, 2], 6) for i in range(5)]
    run = Run(config(max_step_failures=3), lambda plan, result: bool(result.request_ids))
    run.go([(0, r) for r in requests])
    assert all(run.ended[(r.request_id, 0)] is FinishReason.ERROR for r in requests)
    assert run.failures <= 3 * len(requests)
    assert run.scheduler.stats().num_used_blocks == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.data())
def test_random_traces_with_a_poisoned_request_keep_invariants_and_streams(trace, data) -> None:
    cfg, requests, aborts, eos_probability, _ = trace
    poison = data.draw(st.sampled_from([r.request_id for _, r in requests]))
    run = Run(cfg, samples_for(poison), eos_probability)
    run.go(requests, [(at, requests[i][1].request_id) for at, i in aborts])
    assert run.failures <= 2 * len(requests)
    for _, request in requests:
        for index in range(request.sampling.n):
            key = (request.request_id, index)
            assert key in run.ended, f"{key} never ended"
            got, want = run.streams.get(key, []), expected(run.sampler, request, index)
            if request.request_id == poison:
                assert run.ended[key] in (FinishReason.ERROR, FinishReason.ABORT)
            elif run.ended[key] is FinishReason.ABORT:
                assert got == want[:len(got)]
            else:
                assert run.ended[key] is not FinishReason.ERROR, f"{key} failed with the poisoned one"
                assert got == want, f"{key}: got {got}, expected {want}"
    stats = run.scheduler.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
