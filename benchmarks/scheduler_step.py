"""Scheduler time per step (schedule + update) in steady-state decode, prefix caching on.

    python -m benchmarks.scheduler_step [--steps 1000] [--sizes 256 1024] [--no-freeze] [--profile]
                                        [--brownout]

The fake worker produces the results; its time is not counted. Target: <= 1 ms per step at 256.
Both process-CPU time (time.process_time_ns: barely moved by other processes sharing the cores)
and wall time (perf_counter_ns: what a step really takes) are reported, as mean / p50 / p99.

By default the setup's objects are moved out of the collector's reach with gc.freeze(), as the
engine loop should do after warm-up: otherwise a full collection walks every request, token list
and block table of a large batch and lands as a multi-millisecond spike on one unlucky step.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from scheduler_svc.core.brownout import BrownoutConfig
from worker_svc.fake.fake_worker import FakeWorker

BLOCK_SIZE = 16
PROMPT_LEN = 48  # a 32-token shared system prompt + 16 own tokens
WARMUP_STEPS = 20  # admit everything, prefill, settle into decode


def build(num_seqs: int, steps: int, brownout: BrownoutConfig | None = None) -> tuple[Scheduler, FakeWorker]:
    blocks = num_seqs * cdiv(PROMPT_LEN + WARMUP_STEPS + steps + 64, BLOCK_SIZE) + 16
    config = SchedulerConfig(num_blocks=blocks, block_size=BLOCK_SIZE, max_model_len=8192,
                             max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                             enable_prefix_caching=True, max_inflight_steps=1, brownout=brownout)
    scheduler = Scheduler(config)
    system = list(range(1, 33))
    for i in range(num_seqs):
        own = [100 + (i * 16 + j) % 900 for j in range(16)]
        scheduler.add_request(EngineRequest(RequestId(f"r{i}"), tuple(system + own),
                                            SamplingParams(max_tokens=4096, ignore_eos=True)))
    worker = FakeWorker(blocks, BLOCK_SIZE, check_kv=False)
    for _ in range(WARMUP_STEPS):
        scheduler.update(worker.execute(scheduler.schedule()))
    assert scheduler.stats().num_running == num_seqs
    return scheduler, worker


def measure(scheduler: Scheduler, worker: FakeWorker, steps: int) -> dict[str, list[float]]:
    """Per-step schedule and update times (ms), CPU and wall; the worker's time is left out."""
    cpu, wall = time.process_time_ns, time.perf_counter_ns
    out: dict[str, list[float]] = {"cpu": [], "wall": [], "cpu_schedule": [], "cpu_update": []}
    for _ in range(steps):
        c0, w0 = cpu(), wall()
        plan = scheduler.schedule()
        c1, w1 = cpu(), wall()
        result = worker.execute(plan)
        c2, w2 = cpu(), wall()
        scheduler.update(result)
        c3, w3 = cpu(), wall()
        out["cpu"].append(((c1 - c0) + (c3 - c2)) / 1e6)
        out["wall"].append(((w1 - w0) + (w3 - w2)) / 1e6)
        out["cpu_schedule"].append((c1 - c0) / 1e6)
        out["cpu_update"].append((c3 - c2) / 1e6)
    return out


def summary(times: list[float]) -> tuple[float, float, float]:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.fmean(ordered), statistics.median(ordered), p99


def profile(scheduler: Scheduler, worker: FakeWorker, steps: int) -> None:
    """cProfile of the scheduler's calls only (the worker runs outside the profiler)."""
    prof = cProfile.Profile()
    for _ in range(steps):
        plan = prof.runcall(scheduler.schedule)
        prof.runcall(scheduler.update, worker.execute(plan))
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--no-freeze", action="store_true", help="leave the setup to the collector")
    parser.add_argument("--profile", action="store_true", help="print a cProfile instead")
    parser.add_argument("--brownout", action="store_true",
                        help="brownout on (its defaults): its per-step observation is counted")
    args = parser.parse_args(argv)
    print(f"{'running':>8} {'clock':>5} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8}"
          f"  (cpu mean: schedule + update)")
    for size in args.sizes:
        scheduler, worker = build(size, args.steps, BrownoutConfig() if args.brownout else None)
        if not args.no_freeze:
            gc.collect()
            gc.freeze()
        if args.profile:
            profile(scheduler, worker, args.steps)
            continue
        times = measure(scheduler, worker, args.steps)
        for clock in ("cpu", "wall"):
            mean, p50, p99 = summary(times[clock])
            split = (f"  ({statistics.fmean(times['cpu_schedule']):.3f} + "
                     f"{statistics.fmean(times['cpu_update']):.3f})" if clock == "cpu" else "")
            print(f"{size:>8} {clock:>5} {mean:>8.3f} {p50:>8.3f} {p99:>8.3f}{split}")
        gc.unfreeze()


if __name__ == "__main__":
    main()
