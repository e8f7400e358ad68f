"""Property tests: random traces through the scheduler core and the fake worker.

After every step the block accounting holds (per tenant too: each within its KV cap, the
tenants' counts summing to used + cached); every sequence ends exactly once; each finished
sequence's tokens equal what the deterministic fake sampler must produce for it whatever the
scheduling (prefix hits, host-tier offloads and loads, disk-tier writes and loads (across a
worker loss too: the fake's files outlive it), chunking, preemption by recompute or swap,
forks, pipelining); the fake worker's KV check (every attended slot holds the right token, swapped-in
and host-tier-loaded ones included) passes on
every step; the host pool is empty at the end.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker, fake_prompt_logprob

EOS = 0
MAX_MODEL_LEN = 40


@st.composite
def traces(draw, through_disk: bool = False):
    """`through_disk`: prefix caching on, a host tier of 1 or 2 slots over a disk tier, and a
    worker loss in most traces: evictions keep going through the disk and a new worker's listing."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    per_seq = cdiv(MAX_MODEL_LEN, block_size)
    num_cpu_blocks = draw(st.sampled_from([0, 2, per_seq, per_seq * 4]))  # 2: often full
    modes = [None, "recompute", "swap"] if num_cpu_blocks else [None, "recompute"]
    # The prefix cache's host tier: none, 1 or 2 slots (full at once: drops, busy slots), or roomy
    num_offload_blocks = draw(st.sampled_from([1, 2] if through_disk else [0, 0, 1, 2, per_seq * 3]))
    # The disk tier under it: 1 or 2 files (deletes, busy files), or roomy
    num_disk_blocks = draw(st.sampled_from([1, 2, per_seq * 3] if through_disk else [0, 1, 2, per_seq * 3])) \
        if num_offload_blocks else 0
    num_blocks = draw(st.integers(per_seq, per_seq * 4))
    # Tenants (core/tenants.py): a KV cap between one request's worst case and the whole pool (the
    # invariants assert no tenant ever holds more), and fair-share admission on or off.
    def share():
        return (draw(st.integers(per_seq, num_blocks)) + 0.5) / num_blocks
    config = SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=draw(st.integers(3, 8)),
        max_num_batched_tokens=draw(st.integers(4, 32)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 3, 7])),
        enable_prefix_caching=through_disk or draw(st.booleans()), eos_token_ids=(EOS,),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        max_inflight_steps=draw(st.sampled_from([1, 2, 3])), num_cpu_blocks=num_cpu_blocks,
        num_offload_blocks=num_offload_blocks, num_disk_blocks=num_disk_blocks,
        preemption_mode=draw(st.sampled_from(modes)),
        tenant_kv_share=draw(st.sampled_from([1.0, min(1.0, share())])),
        tenant_fairness=draw(st.sampled_from(["off", "vtc"])))
    tenant_shares = {"": 0.0, "a": 0.0, "b": draw(st.sampled_from([0.0, min(1.0, share())]))}
    bases = draw(st.lists(st.lists(st.integers(1, 6), min_size=0, max_size=20), min_size=1, max_size=3))
    requests = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.sampled_from(bases)) + draw(st.lists(st.integers(1, 9), min_size=0, max_size=8))
        prompt = (prompt or [7])[:30]
        max_tokens = draw(st.integers(1, MAX_MODEL_LEN - len(prompt)))
        sampling = SamplingParams(
            n=draw(st.integers(1, 3)), max_tokens=draw(st.sampled_from([max_tokens, None])),
            min_tokens=draw(st.integers(0, 2)) if max_tokens >= 2 else 0,
            ignore_eos=draw(st.booleans()), stop_token_ids=tuple(draw(st.sets(st.integers(1, 40), max_size=2))),
            prompt_logprobs=draw(st.sampled_from([None, None, 0, 2])))
        session = draw(st.sampled_from([None, None, "s0", "s1"]))  # a lease (tiers/sessions.py), TTL in steps
        request = EngineRequest(RequestId(f"r{i}"), tuple(prompt), sampling, priority=draw(st.integers(0, 2)),
                                cache_salt=draw(st.sampled_from([None, None, "tenant"])), session_id=session,
                                session_ttl=draw(st.sampled_from([3.0, 50.0])) if session else 0.0,
                                tenant=(tenant := draw(st.sampled_from(sorted(tenant_shares)))),
                                kv_share=tenant_shares[tenant])
        requests.append((draw(st.integers(0, 12)), request))  # (arrival step, request)
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, len(requests) - 1)), max_size=3))
    worker_loss_step = draw(st.integers(1, 30) if through_disk else st.one_of(st.none(), st.integers(1, 30)))
    return config, requests, aborts, draw(st.floats(0.0, 0.3)), worker_loss_step


def expected(sampler: FakeSampler, request: EngineRequest, seq_index: int) -> list[int]:
    sampling = request.sampling
    max_tokens = sampling.max_tokens or MAX_MODEL_LEN - len(request.prompt_token_ids)
    stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else {EOS})
    return sampler.reference_stream(list(request.prompt_token_ids), seq_index, sampling, max_tokens, stop_ids)


def run(config, requests, aborts, eos_probability, worker_loss_step):
    sampler = FakeSampler(vocab_size=40, eos_token_id=EOS, eos_probability=eos_probability)
    clock = [0.0]  # session leases expire after their TTL in steps
    scheduler = Scheduler(config, clock=lambda: clock[0])
    disk: OrderedDict = OrderedDict()  # the disk tier's files: they outlive a worker loss
    worker = FakeWorker(config.num_blocks, config.block_size, sampler,
                        num_cpu_blocks=config.num_cpu_blocks + config.num_offload_blocks, disk=disk)
    streams: dict[tuple[str, int], list] = {}
    ended: dict[tuple[str, int], FinishReason] = {}
    prompt_logprobs: dict[str, list] = {}

    def record(deltas):
        for delta in deltas:
            key = (delta.request_id, delta.seq_index)
            assert key not in ended, f"{key} got a delta after it ended"
            if delta.prompt_logprobs is not None:
                assert delta.request_id not in prompt_logprobs, f"{key}: prompt logprobs twice"
                assert delta.seq_index == 0 and delta.new_token_ids and key not in streams, \
                    f"{key}: prompt logprobs not with the first token of sequence 0"
                prompt_logprobs[delta.request_id] = delta.prompt_logprobs
            streams.setdefault(key, []).extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                ended[key] = delta.finish_reason

    pending: deque = deque()
    for step in range(2000):
        clock[0] = float(step)
        for arrival, request in requests:
            if arrival == step:
                scheduler.add_request(request)
        for at, index in aborts:
            if at == step:
                record(scheduler.abort(requests[index][1].request_id))
        if step == worker_loss_step:  # in-flight results are lost with the worker
            scheduler.reset_after_worker_loss()
            pending.clear()
            worker = FakeWorker(config.num_blocks, config.block_size, sampler,
                                num_cpu_blocks=config.num_cpu_blocks + config.num_offload_blocks, disk=disk)
            scheduler.restore_disk_tier(tuple(block for _, block in disk.values()))  # the new Init's listing
        scheduler.check_invariants()
        if step > 12 and not scheduler.has_unfinished_requests() and not pending:
            for _, request in requests:  # what the sessions still pin goes back to the pool
                if request.session_id is not None:
                    scheduler.end_session(request.cache_salt, request.session_id)
            break
        plan = scheduler.schedule()
        if plan is not None:
            pending.append(worker.execute(plan))
        if pending and (plan is None or len(pending) >= config.max_inflight_steps):
            record(scheduler.update(pending.popleft()))
        elif plan is None:
            assert not scheduler.has_unfinished_requests() or step < 12, "deadlock: nothing to do"
    else:
        raise AssertionError("trace did not finish")
    scheduler.check_invariants()
    stats = scheduler.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
    assert stats.num_swapped == 0 and stats.cpu_kv_usage == 0.0
    return sampler, streams, ended, prompt_logprobs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_random_traces_keep_invariants_and_streams(trace):
    check_trace(trace)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(through_disk=True))
def test_random_traces_through_the_disk_tier_and_a_worker_loss(trace):
    check_trace(trace)


def check_trace(trace) -> None:
    sampler, streams, ended, prompt_logprobs = run(*trace)
    requests = trace[1]
    for _, request in requests:
        check_prompt_logprobs(request, prompt_logprobs.get(request.request_id), streams)
        for index in range(request.sampling.n):
            key = (request.request_id, index)
            assert key in ended, f"{key} never ended"
            want = expected(sampler, request, index)
            got = streams.get(key, [])
            if ended[key] is FinishReason.ABORT:
                assert got == want[:len(got)], f"{key}: {got} is not a prefix of {want}"
            else:
                assert got == want, f"{key}: got {got}, expected {want}"
                last = got[-1]
                stop = last in request.sampling.stop_token_ids or (
                    last == EOS and not request.sampling.ignore_eos)
                assert ended[key] is (FinishReason.STOP if stop and len(got) >= request.sampling.min_tokens
                                      else FinishReason.LENGTH)


def check_prompt_logprobs(request: EngineRequest, got: list | None, streams: dict) -> None:
    """Asked for and sequence 0 sampled: each prompt token from the second on, exactly once, in
    order, whatever the chunking, preemption, pipelining or worker loss (prefix hits skipped)."""
    prompt, top_k = list(request.prompt_token_ids), request.sampling.prompt_logprobs
    if top_k is None or len(prompt) == 1 or not streams.get((request.request_id, 0)):
        assert got is None, f"{request.request_id}: prompt logprobs it should not have"
        return
    assert got == [fake_prompt_logprob(prompt, i, top_k) for i in range(1, len(prompt))], request.request_id
