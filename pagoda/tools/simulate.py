"""Why paged KV and continuous batching: figures computed by driving the real scheduler core.

    python -m pagoda.tools.simulate [--requests 200] [--seed 0]

The fake worker stands in for the model (deterministic tokens, EOS off: output lengths are exact).
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import StepResult
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeWorker


def drive(scheduler, worker: FakeWorker, pipeline_depth: int = 1, max_steps: int = 100_000,
          on_step=None) -> dict[tuple[str, int], list]:
    """Run scheduler + fake worker until no request is left; results are delivered `pipeline_depth`
    plans late (1 = synchronous). Returns {(request_id, seq_index): [tokens..., finish_reason]}.
    `on_step(deltas)` runs after every update (tests check invariants there)."""
    streams: dict[tuple[str, int], list] = {}
    pending: deque[StepResult] = deque()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not pending:
            return streams
        plan = scheduler.schedule() if len(pending) < pipeline_depth else None
        if plan is not None:
            pending.append(worker.execute(plan))
            continue
        if not pending:
            raise AssertionError("unfinished requests, nothing in flight, and no plan: deadlock")
        deltas = scheduler.update(pending.popleft())
        for delta in deltas:
            stream = streams.setdefault((delta.request_id, delta.seq_index), [])
            assert not (stream and stream[-1] is not None and not isinstance(stream[-1], int)), \
                f"delta after the end of {delta.request_id}#{delta.seq_index}"
            stream.extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                stream.append(delta.finish_reason)
        if on_step is not None:
            on_step(deltas)
    raise AssertionError(f"not finished after {max_steps} steps")


OUTPUT_LENGTHS = [32, 128, 64, 256]


def _request(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _run(config: SchedulerConfig, requests: list[EngineRequest]) -> dict[str, int]:
    """Run to completion; return each sequence's largest block table (as the worker saw it)."""
    scheduler = Scheduler(config)
    worker = FakeWorker(config.num_blocks, config.block_size, check_kv=False)
    for request in requests:
        scheduler.add_request(request)
    peak: dict[str, int] = {}

    def on_step(_deltas) -> None:
        for rid, state in worker.resident.items():
            peak[rid] = max(peak.get(rid, 0), len(state.block_table))

    drive(scheduler, worker, on_step=on_step)
    return peak


def static_vs_continuous() -> list[str]:
    longest, useful = max(OUTPUT_LENGTHS), sum(OUTPUT_LENGTHS)
    reserved = longest * len(OUTPUT_LENGTHS)
    config = SchedulerConfig(num_blocks=64, block_size=16, max_model_len=512)
    peak = _run(config, [_request(f"r{i}", [1], n) for i, n in enumerate(OUTPUT_LENGTHS)])
    paged = sum(peak.values())
    static_blocks = len(OUTPUT_LENGTHS) * cdiv(longest, 16)
    return [
        f"== static vs continuous batching, output lengths {OUTPUT_LENGTHS}",
        f"static: {reserved:,} reserved slots for {useful} useful tokens = {useful / reserved:.1%} "
        f"(every sequence holds its slot until the longest, {longest}, finishes)",
        f"continuous: a slot is freed the step its sequence finishes: {useful} slot-steps for "
        f"{useful} tokens = 100.0%; the freed slots admit new requests",
        "== blocks at block_size 16 for those lengths",
        f"blocks, static worst case vs paged: {static_blocks} vs {paged} "
        f"(paged per sequence {[peak[f'r{i}'] for i in range(len(OUTPUT_LENGTHS))]}, measured)",
    ]


def _peak_blocks_with_warm_cache(config: SchedulerConfig, warm: EngineRequest,
                                 requests: list[EngineRequest]) -> int:
    """Run `warm` alone (it fills the prefix cache), then `requests` together: their peak blocks."""
    scheduler = Scheduler(config)
    worker = FakeWorker(config.num_blocks, config.block_size, check_kv=False)
    scheduler.add_request(warm)
    drive(scheduler, worker)
    for request in requests:
        scheduler.add_request(request)
    peak = 0

    def on_step(_deltas) -> None:
        nonlocal peak
        peak = max(peak, scheduler.stats().num_used_blocks)

    drive(scheduler, worker, on_step=on_step)
    return peak


def shared_system_prompt(conversations: int = 16, system_len: int = 200, tail_len: int = 24) -> list[str]:
    block_size = 16
    system = [1000 + i for i in range(system_len)]
    per_conv = cdiv(system_len, block_size)
    unshared, full_shared = conversations * per_conv, system_len // block_size
    warm = _request("warm", system + [1] * tail_len, 4)
    convs = [_request(f"c{c}", system + [c + 2] * tail_len, 4) for c in range(conversations)]
    peak = {caching: _peak_blocks_with_warm_cache(
        SchedulerConfig(num_blocks=512, block_size=block_size, max_model_len=1024,
                        enable_prefix_caching=caching, max_num_batched_tokens=8192), warm, convs)
        for caching in (False, True)}
    return [
        f"== {conversations} conversations sharing a {system_len}-token system prompt (block_size 16)",
        f"system prompt blocks, unshared vs shared: {unshared} vs {per_conv} shared + tails "
        f"({conversations} x {per_conv} unshared; {full_shared} full blocks hit the prefix cache; the partial one is per conversation)",
        f"measured peak blocks, {tail_len}-token tails and 4 output tokens each: {peak[False]} without "
        f"prefix caching, {peak[True]} with it",
    ]


def sharegpt_trace(num_requests: int, seed: int, rate: float) -> list[tuple[float, int, int]]:
    """(arrival step, prompt len, output len): Poisson arrivals, lognormal lengths (means ~161/~338)."""
    rng = random.Random(seed)
    sigma = 1.0
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        prompt = min(1024, max(1, round(rng.lognormvariate(math.log(161) - sigma**2 / 2, sigma))))
        output = min(1024, max(1, round(rng.lognormvariate(math.log(338) - sigma**2 / 2, sigma))))
        out.append((t, prompt, output))
    return out


def run_trace(trace: list[tuple[float, int, int]], block_size: int, kv_slots: int) -> tuple[float, int, int]:
    """Return (KV slots allocated but unused %, preemptions, peak running) over the whole run."""
    config = SchedulerConfig(num_blocks=kv_slots // block_size, block_size=block_size, max_model_len=2048,
                             max_num_seqs=256, max_num_batched_tokens=2048, enable_prefix_caching=False)
    scheduler, worker = Scheduler(config), FakeWorker(config.num_blocks, block_size, check_kv=False)
    allocated = resident = peak = step = 0
    pending = list(reversed(trace))
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[-1][0] <= step:
            _, prompt_len, output_len = pending.pop()
            scheduler.add_request(_request(f"q{len(trace) - len(pending)}", [7] * prompt_len, output_len))
        step += 1
        plan = scheduler.schedule()
        if plan is None:
            continue
        scheduler.update(worker.execute(plan))
        stats = scheduler.stats()
        allocated += stats.num_used_blocks * block_size
        resident += stats.num_resident_tokens
        peak = max(peak, stats.num_running)
    return 100.0 * (1 - resident / allocated), scheduler.stats().num_preemptions, peak


def trace_table(num_requests: int, seed: int) -> list[str]:
    trace = sharegpt_trace(num_requests, seed, rate=0.5)
    kv_slots = 32768
    lines = [f"== Poisson trace: {num_requests} requests, 0.5 per step, mean prompt "
             f"{sum(p for _, p, _ in trace) / len(trace):.0f}, mean output {sum(o for *_, o in trace) / len(trace):.0f}"
             f" tokens (lognormal, sigma 1), {kv_slots:,} KV token slots",
             f"{'block size':>10} {'unused %':>9} {'preemptions':>12} {'peak running':>13}"]
    for block_size in (8, 16, 32, 64, 128):
        unused, preemptions, peak = run_trace(trace, block_size, kv_slots)
        lines.append(f"{block_size:>10} {unused:>9.1f} {preemptions:>12} {peak:>13}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Paged KV cache and continuous batching, simulated")
    parser.add_argument("--requests", type=int, default=200, help="requests in the Poisson trace")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for section in (static_vs_continuous(), shared_system_prompt(), trace_table(args.requests, args.seed)):
        print("\n".join(section), end="\n\n")


if __name__ == "__main__":
    main()
