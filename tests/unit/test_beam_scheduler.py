"""Beam search in the scheduler core (beam_group.py) over the fake worker: exact block ids of the
first fork and of a re-pointing step, and random traces (pools that preempt, pipelining, prefix
caching, swap preemption, aborts, plain requests beside beam groups) where the invariant holds after every step,
the fake worker's KV check passes (each beam attends to its own tokens: copy-on-write is right)
and every group returns the beams a plain, unscheduled beam search returns."""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams, num_beam_candidates
from pagoda.contract.step import BeamUpdate, BlockCopy, StepResult, TableUpdate, TokenLogprobs
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from scheduler_svc.core.beam_search import BeamSearch
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

EOS = 0
MAX_MODEL_LEN = 32


def candidates(*tokens: int) -> TokenLogprobs:
    top = [(t, -0.1 * (i + 1)) for i, t in enumerate(tokens)]
    return TokenLogprobs(top[0][1], top)


def test_first_fork_shares_the_prompt_and_copies_the_partial_block_on_write():
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=8,
                                  max_num_batched_tokens=64, eos_token_ids=(EOS,)))
    s.add_request(EngineRequest(RequestId("a"), tuple(range(10, 20)), SamplingParams(
        n=2, beam_width=2, temperature=0, max_tokens=5)))
    plan = s.schedule()
    assert plan.new_requests[0].block_ids == [0, 1, 2]  # 10 prompt tokens, 4 per block
    s.update(StepResult(plan.step_id, ["a"], [5], [candidates(5, 6, 7, 8)]))
    s.check_invariants()
    plan = s.schedule()
    assert plan.beam_updates == [BeamUpdate("a", "a", 5), BeamUpdate("a#1", "a", 6)]
    # Both beams write position 10, in block 2 (shared): the first copies it, the second keeps it.
    assert plan.block_copies == [BlockCopy(2, 3)]
    assert plan.table_updates == [TableUpdate("a", 2, [3])]
    assert plan.num_scheduled_tokens == {}
    assert [s._queues.live[r].block_table for r in ("a", "a#1")] == [[0, 1, 3], [0, 1, 2]]
    s.check_invariants()
    # Beam 1 (tokens ... 6) is the better parent of both next beams: beam 0's own block 3 is freed,
    # both tables point at [0, 1, 2] and the first write copies block 2 again (into a free block).
    s.update(StepResult(plan.step_id, ["a", "a#1"], [1, 1],
                        [TokenLogprobs(-2.0, [(1, -2.0), (2, -2.1), (3, -2.2), (4, -2.3)]),
                         TokenLogprobs(-0.01, [(7, -0.01), (8, -0.02), (9, -3.0)])]))
    plan = s.schedule()
    assert plan.beam_updates == [BeamUpdate("a", "a#1", 7), BeamUpdate("a#1", "a#1", 8)]
    assert s._kv.pool.ref_count(3) == 0  # beam 0's own block: no child kept it
    assert plan.block_copies == [BlockCopy(2, 4)] and plan.table_updates == [TableUpdate("a", 2, [4])]
    assert [s._queues.live[r].block_table for r in ("a", "a#1")] == [[0, 1, 4], [0, 1, 2]]
    assert [s._queues.live[r].token_ids[10:] for r in ("a", "a#1")] == [[6, 7], [6, 8]]
    s.check_invariants()


def reference_beams(sampler: FakeSampler, request: EngineRequest) -> list[list[int]]:
    """The beams a plain loop returns with the fake worker's candidates (no blocks, no batching)."""
    sampling = request.sampling
    stops = sampling.stop_tokens((EOS,))
    width = sampling.beam_width
    count = 2 * width + len(sampling.stop_token_ids) + 1  # what the fake worker reports
    search = BeamSearch(width, sampling.length_penalty, stops, num_beam_candidates(width, len(stops)))
    prompt = list(request.prompt_token_ids)
    max_tokens = sampling.max_tokens or MAX_MODEL_LEN - len(prompt)
    beams, cums = [[]], [0.0]
    while not search.done:
        cands = [sampler.beam_candidates(prompt + beam, count) for beam in beams]
        nexts = search.step(beams, cums, cands, max_tokens)
        beams = [beams[n.parent] + [n.token_id] for n in nexts]
        cums = [n.cum_logprob for n in nexts]
    return [list(h.token_ids) for h in search.best(sampling.n)]


@st.composite
def traces(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    per_seq = cdiv(MAX_MODEL_LEN, block_size)
    num_cpu_blocks = draw(st.sampled_from([0, 2, per_seq * 4]))  # swap preemption: 2 is often full
    config = SchedulerConfig(
        num_cpu_blocks=num_cpu_blocks,
        preemption_mode=draw(st.sampled_from([None, "recompute", "swap"] if num_cpu_blocks else [None])),
        num_blocks=draw(st.integers(per_seq, per_seq * 6)), block_size=block_size,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=draw(st.integers(4, 10)),
        max_num_batched_tokens=draw(st.integers(8, 32)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 3, 7])),
        enable_prefix_caching=draw(st.booleans()), eos_token_ids=(EOS,),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        max_inflight_steps=draw(st.sampled_from([1, 2, 3])))
    requests = []
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(1, 9), min_size=1, max_size=16))
        width = draw(st.sampled_from([0, 1, 2, 3, 4]))
        # A group must fit the pool with every beam at full length (add_request's rule): small
        # pools make groups preempt each other, whole.
        room = (config.num_blocks // width) * block_size + 1 - len(prompt) if width else MAX_MODEL_LEN
        if room < 1:
            width, room = 0, MAX_MODEL_LEN
        max_tokens = draw(st.integers(1, min(room, MAX_MODEL_LEN - len(prompt))))
        stops = tuple(draw(st.sets(st.integers(1, 39), max_size=2)))
        if width:
            sampling = SamplingParams(n=draw(st.integers(1, width)), beam_width=width, temperature=0,
                                      max_tokens=max_tokens, stop_token_ids=stops,
                                      length_penalty=draw(st.sampled_from([1.0, 0.0, 2.0])))
        else:
            sampling = SamplingParams(n=draw(st.integers(1, 2)), max_tokens=max_tokens, stop_token_ids=stops)
        requests.append((draw(st.integers(0, 8)), EngineRequest(RequestId(f"r{i}"), tuple(prompt), sampling,
                                                                priority=draw(st.integers(0, 2)))))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, len(requests) - 1)), max_size=2))
    return config, requests, aborts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_random_traces_keep_the_invariant_and_return_the_reference_beams(trace):
    config, requests, aborts = trace
    sampler = FakeSampler(vocab_size=40, eos_token_id=EOS, eos_probability=0.05)
    scheduler = Scheduler(config)
    worker = FakeWorker(config.num_blocks, config.block_size, sampler,
                        num_cpu_blocks=config.num_cpu_blocks + config.num_offload_blocks)
    outputs: dict[tuple[str, int], list[int]] = {}
    finished: set[tuple[str, int]] = set()
    aborted: set[str] = set()
    pending: deque = deque()

    def record(deltas) -> None:
        for delta in deltas:
            key = (delta.request_id, delta.seq_index)
            assert key not in finished, f"{key} got a delta after it ended"
            outputs.setdefault(key, []).extend(delta.new_token_ids)
            if delta.finished:
                finished.add(key)

    for step in range(3000):
        for arrival, request in requests:
            if arrival == step:
                scheduler.add_request(request)
        for when, index in aborts:
            if when == step:
                rid = requests[index][1].request_id
                deltas = scheduler.abort(rid)
                if deltas:
                    aborted.add(rid)
                record(deltas)
        while (plan := scheduler.schedule()) is not None:
            pending.append(worker.execute(plan))
            scheduler.check_invariants()
        if pending:
            record(scheduler.update(pending.popleft()))
            scheduler.check_invariants()
        elif not scheduler.has_unfinished_requests() and step > 8:
            break
    assert not scheduler.has_unfinished_requests()
    scheduler._kv.release_all_deferred()
    assert scheduler.stats().num_used_blocks == 0
    for _, request in requests:
        rid, sampling = request.request_id, request.sampling
        assert all((rid, i) in finished for i in range(sampling.n))
        if sampling.beam_width and rid not in aborted:
            assert [outputs[(rid, i)] for i in range(sampling.n)] == reference_beams(sampler, request)


def test_poison_isolation_with_beam_groups():
    """A step that fails for a poisoned plain request: the beam groups beside it are re-run (one
    suspect at a time, then batched) and still return the reference beams; a poisoned beam group
    fails alone, all n outputs with ERROR."""
    from tests.unit.test_poison_isolation import Run, config, samples_for

    sampler = FakeSampler(vocab_size=40, eos_token_id=EOS)
    beams = [EngineRequest(RequestId(f"b{i}"), (1 + i, 2, 3), SamplingParams(
        n=2, beam_width=3, temperature=0, max_tokens=6)) for i in range(3)]
    plain = EngineRequest(RequestId("poison"), (4, 4, 4), SamplingParams(temperature=0, max_tokens=6))
    for poisoned in ("poison", "b1"):
        run = Run(config(max_inflight_steps=2), samples_for(poisoned))
        run.go([(0, beams[0]), (0, beams[1]), (2, plain), (3, beams[2])])
        assert run.failures == 2
        for request in beams + [plain]:
            rid = request.request_id
            if rid == poisoned:
                assert all(run.ended[(rid, i)].value == "error" for i in range(request.sampling.n))
            elif request.sampling.beam_width:
                assert [run.streams[(rid, i)] for i in range(2)] == reference_beams(sampler, request)
        assert run.scheduler.stats().num_used_blocks == 0
