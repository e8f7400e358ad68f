"""Scheduler CPU time per step (schedule + update) in steady-state decode, prefix caching on.

    python -m benchmarks.scheduler_step [--steps 300]

The fake worker produces the results; its time is not counted. Target: <= 1 ms per step at 256.
"""

from __future__ import annotations

import argparse
import statistics
import time

from scheduler_svc.core import EngineRequest, RequestId, SamplingParams, Scheduler, SchedulerConfig
from scheduler_svc.fake_worker import FakeWorker

BLOCK_SIZE = 16
PROMPT_LEN = 48  # a 32-token shared system prompt + 16 own tokens


def build(num_seqs: int, steps: int) -> tuple[Scheduler, FakeWorker]:
    blocks = num_seqs * (-(-(PROMPT_LEN + steps + 64) // BLOCK_SIZE)) + 16
    config = SchedulerConfig(num_blocks=blocks, block_size=BLOCK_SIZE, max_model_len=8192,
                             max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                             enable_prefix_caching=True, max_inflight_steps=1)
    scheduler = Scheduler(config)
    system = list(range(1, 33))
    for i in range(num_seqs):
        own = [100 + (i * 16 + j) % 900 for j in range(16)]
        scheduler.add_request(EngineRequest(RequestId(f"r{i}"), tuple(system + own),
                                            SamplingParams(max_tokens=4096, ignore_eos=True)))
    return scheduler, FakeWorker(blocks, BLOCK_SIZE, check_kv=False)


def measure(num_seqs: int, steps: int) -> list[float]:
    scheduler, worker = build(num_seqs, steps)
    for _ in range(20):  # admit everything, prefill, settle into decode
        scheduler.update(worker.execute(scheduler.schedule()))
    assert scheduler.stats().num_running == num_seqs
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        result = worker.execute(plan)
        t2 = time.perf_counter()
        scheduler.update(result)
        t3 = time.perf_counter()
        times.append((t1 - t0) + (t3 - t2))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args(argv)
    print(f"{'running':>8} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for size in args.sizes:
        times = sorted(t * 1e3 for t in measure(size, args.steps))
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        print(f"{size:>8} {statistics.fmean(times):>8.3f} {statistics.median(times):>8.3f} {p99:>8.3f}")


if __name__ == "__main__":
    main()
