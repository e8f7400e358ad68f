"""Per-step cost of the scheduler<->worker protocol: plan bytes, and overhead against model time.

    python -m benchmarks.plan_overhead [--model models/pagoda-tiny] [--batch-sizes 64 256] [--quick]
    python -m benchmarks.plan_overhead --breakdown [--breakdown-models models/pagoda-tiny ...]
        [--breakdown-batches 1 16] [--out benchmarks/results/step_breakdown.json]

1. Plan bytes (in-process, FakeWorker): serialised StepPlan size of decode-only steps at B running
   requests, against the state a full-state plan would carry (every request's NewRequest).
2. Step wall time with real processes on loopback, with and without pipelining: a fake worker that
   answers at once (= scheduler + transport overhead), then the tiny model on CPU; plus the model's
   own step time (forward + sample, in-process ModelRunner) at the same batch, for comparison.
3. --breakdown (instead of 1 and 2): a decode step cut into its parts in-process, per model and
   batch, then one request at a time through the launched stack with the CPU each service spends
   per output token (benchmarks/step_breakdown.py says how each figure is taken).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks import step_breakdown
from benchmarks.result_file import write_result
from pagoda.contract import worker_codec as convert
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import NewRequestData, StepPlan
from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import EngineRequest
from scheduler_svc.core.scheduler import Scheduler
from tests.e2e.conftest import start_scheduler, start_worker
from worker_svc.fake.fake_worker import FakeWorker

PROMPT_LEN, BLOCK_SIZE = 32, 16
DECODE = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


def decode_steps(batch: int, num_steps: int):
    """Yield (plan, scheduler) for decode-only steps with `batch` running requests."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=batch * 80, block_size=BLOCK_SIZE, max_model_len=2048,
                                          max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN,
                                          max_inflight_steps=1))
    worker = FakeWorker(batch * 80, BLOCK_SIZE, check_kv=False)
    for i in range(batch):
        scheduler.add_request(EngineRequest(RequestId(f"req-{i:04d}"), tuple(range(i, i + PROMPT_LEN)), DECODE))
    for step in range(num_steps + 1):
        plan = scheduler.schedule()
        if step > 0:  # step 0 is the prefill of everyone
            yield plan, scheduler, worker
        scheduler.update(worker.execute(plan))


def plan_bytes(batch: int, num_steps: int = 64) -> dict:
    sizes, resident = [], {}
    for plan, _, worker in decode_steps(batch, num_steps):
        assert not plan.new_requests, "not a decode-only step"
        sizes.append(convert.plan_to_pb(plan, epoch=1 << 62).ByteSize())
        resident = worker.resident
    # What a full-state plan would carry: every running request as a NewRequest.
    full = StepPlan(0, new_requests=[_as_new(rid, st) for rid, st in resident.items()])
    state = convert.plan_to_pb(full, epoch=1 << 62).ByteSize()
    return {"batch": batch, "mean": statistics.mean(sizes), "max": max(sizes), "min": min(sizes),
            "state": state}


def _as_new(rid, st) -> NewRequestData:
    return NewRequestData(rid, st.token_ids, st.num_prompt_tokens, st.block_table, st.num_computed, 1,
                          st.sampling)


def model_step_seconds(model: str, batch: int, num_steps: int = 8) -> float:
    """Forward + sample seconds of a decode-only step of the tiny model in-process (CPU, fp32)."""
    from pagoda.entrypoints.llm import LLM

    llm = LLM(model=model, device="cpu", dtype="float32", max_num_seqs=batch,
              max_num_batched_tokens=batch * PROMPT_LEN, num_gpu_blocks_override=batch * 8)
    for i in range(batch):
        llm.scheduler.add_request(EngineRequest(RequestId(f"m{i}"), tuple(range(4 + i, 4 + i + PROMPT_LEN)),
                                                SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)))
    times = []
    for step in range(num_steps + 1):
        result = llm.runner.execute(llm.scheduler.schedule())
        llm.scheduler.update(result)
        if step > 0:
            times.append(result.forward_seconds + result.sample_seconds)
    return statistics.median(times)


async def served_step_seconds(target: str, batch: int, window_steps: int) -> float:
    """Wall seconds per step in steady decode with `batch` streams (measured by GetStats num_steps)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        started = asyncio.Event()
        first_tokens = 0

        async def stream(i: int) -> None:
            nonlocal first_tokens
            request = engine_pb2.GenerateRequest(
                request_id=f"b{i}", prompt_token_ids=list(range(4 + i, 4 + i + PROMPT_LEN)),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=100000 // batch + window_steps * 3,
                                                   ignore_eos=True))
            async for _ in stub.Generate(request):
                if not started.is_set():
                    first_tokens += 1
                    if first_tokens == batch:
                        started.set()

        tasks = [asyncio.create_task(stream(i)) for i in range(batch)]
        await started.wait()
        before, t0 = await stub.GetStats(engine_pb2.GetStatsRequest()), time.perf_counter()
        while (now := await stub.GetStats(engine_pb2.GetStatsRequest())).num_steps - before.num_steps < window_steps:
            await asyncio.sleep(0.05)  # sampling interval of the measurement, not synchronisation
        wall = time.perf_counter() - t0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return wall / (now.num_steps - before.num_steps)


def served(worker_flags: dict, batch: int, pipelining: bool, window_steps: int, logs: Path) -> float:
    worker = start_worker(worker_flags.pop("model", None), logs, **worker_flags)
    try:
        scheduler = start_scheduler(worker.target, logs, max_num_seqs=batch,
                                    max_num_batched_tokens=batch * PROMPT_LEN, no_pipelining=not pipelining,
                                    log_level="warning")
        try:
            return asyncio.run(served_step_seconds(scheduler.target, batch, window_steps))
        finally:
            scheduler.stop()
    finally:
        worker.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/pagoda-tiny")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    p.add_argument("--window-steps", type=int, default=100)
    p.add_argument("--skip-model", action="store_true", help="fake worker only")
    p.add_argument("--breakdown", action="store_true", help="section 3 only: the per-step breakdown")
    p.add_argument("--breakdown-models", nargs="+", default=["models/pagoda-tiny", "models/smollm2-135m-instruct"])
    p.add_argument("--breakdown-batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--breakdown-steps", type=int, default=60)
    p.add_argument("--breakdown-threads", type=int, default=None,
                   help="torch threads in-process (default: torch's); 1 steadies the forward on a busy machine")
    p.add_argument("--served-requests", type=int, default=4, help="0: skip the served part")
    p.add_argument("--served-output-len", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write the breakdown as JSON here")
    args = p.parse_args()
    if args.breakdown:
        breakdown(args)
        return
    print("1. plan bytes per decode-only step (serialised StepPlan) vs the full state")
    for batch in args.batch_sizes:
        r = plan_bytes(batch)
        print(f"   B={batch:4d}: mean {r['mean']:7.1f} B  (min {r['min']}, max {r['max']})   "
              f"full state {r['state']:,} B  -> {r['mean'] / r['state']:.4%}")
    logs = Path(tempfile.mkdtemp(prefix="plan_overhead_"))
    print("2. step wall time on loopback, real processes (ms/step)")
    for batch in args.batch_sizes:
        for pipelining in (True, False):
            fake = served({"fake": True, "num_gpu_blocks_override": batch * 80, "log_level": "warning"},
                          batch, pipelining, args.window_steps, logs)
            line = f"   B={batch:4d} pipelining={'on ' if pipelining else 'off'}: fake worker {fake * 1e3:7.2f}"
            if not args.skip_model:
                model = served({"model": args.model, "device": "cpu", "dtype": "float32",
                                "num_gpu_blocks_override": batch * 8, "log_level": "warning"},
                               batch, pipelining, max(args.window_steps // 4, 10), logs)
                line += f"   tiny model {model * 1e3:7.2f}"
            print(line, flush=True)
        if not args.skip_model:
            print(f"   B={batch:4d} model step alone (in-process forward+sample): "
                  f"{model_step_seconds(args.model, batch) * 1e3:7.2f}", flush=True)


def breakdown(args: argparse.Namespace) -> dict:
    result: dict = {"in_process_ms": {}, "served": {}, "torch_threads": args.breakdown_threads}
    if args.breakdown_threads:
        import torch

        torch.set_num_threads(args.breakdown_threads)
    print("3a. decode step parts in-process, median wall ms per step")
    print(f"   {'model':32s} {'B':>3s} " + " ".join(f"{part[:12]:>12s}" for part in (*step_breakdown.PARTS, "step")))
    for model in args.breakdown_models:
        for batch in args.breakdown_batches:
            parts = step_breakdown.step_parts(model, batch, args.breakdown_steps)
            result["in_process_ms"][f"{model} B={batch}"] = parts
            print(f"   {Path(model).name:32s} {batch:3d} " + " ".join(f"{parts[k]:12.3f}" for k in parts), flush=True)
    try:
        building = step_breakdown.input_building([1, 16, 64, 256])
    except ImportError:  # a tree from before the decode buffers
        building = {}
    if building:
        result["input_building_ms"] = building
        print("3b. decode input building alone, ms per call: general builder -> fixed buffers")
        for batch, ms in building.items():
            print(f"   B={batch:4d}: {ms['general']:.4f} -> {ms['buffers']:.4f}")
    if args.served_requests:
        logs = Path(tempfile.mkdtemp(prefix="step_breakdown_"))
        print(f"3c. served, one request at a time ({args.served_output_len} tokens, greedy): "
              "CPU ms per output token by process")
        for model, flags in [(args.breakdown_models[0], ("--fake",)), *((m, ()) for m in args.breakdown_models)]:
            label = f"{Path(model).name}{' --fake' if flags else ''}"
            served = step_breakdown.served_cpu_per_token(model, args.served_requests, args.served_output_len,
                                                         logs / f"{label.replace(' ', '')}.log", flags)
            result["served"][label] = served
            cpu = "  ".join(f"{name} {ms:.3f}" for name, ms in served["cpu_ms_per_token"].items())
            print(f"   {label:36s} TPOT p50 {served['tpot_median_ms']:7.2f} ms   cpu/token: {cpu}", flush=True)
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
