"""Tensor-parallel overhead on CPU (gloo): what rank 0's plan broadcast costs per step, and the step
time of TP=1 vs TP=2 on the tiny model at a few decode batch sizes.

    python -m benchmarks.tp_overhead --model models/pagoda-tiny [--batch-sizes 1 8 32] [--steps 20]

Part 1 times three ways to ship one plan to 2 ranks (rank 0 sends, rank 1 receives; the median of
`--iters` round trips, each ended by a barrier so the receiver's unpickle is included):
  inline     the ControlChannel: one broadcast of a fixed [8-byte length | 8 KiB] buffer
  two-step   a length broadcast, then the pickled bytes
  object     torch.distributed.broadcast_object_list
for an empty decode plan and a plan with 8 new 512-token requests (past the inline size);
"(barrier only)" is the cost of the timing barrier itself, to subtract.
Part 2 runs `--steps` decode steps (empty plans: every resident request +1 token) after a prefill
and reports the median step time.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import NewRequestData, StepPlan

MAX_DECODE_STEPS = 16  # 32 prompt tokens + 16 decodes fill the 3 blocks each request is given


def sample_plans() -> dict[str, StepPlan]:
    big = StepPlan(step_id=7, new_requests=[
        NewRequestData(RequestId(f"r{i}"), list(range(512)), 512, list(range(32 * i, 32 * i + 32)), 0, 512,
                       SamplingParams(temperature=0.0, max_tokens=16)) for i in range(8)])
    return {"decode (empty)": StepPlan(step_id=7), "8 x 512-token prompts": big}


def _two_step_send(message: object, group) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    dist.broadcast(torch.tensor([payload.numel()]), src=0, group=group)
    dist.broadcast(payload, src=0, group=group)


def _two_step_receive(group) -> object:
    length = torch.empty(1, dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return pickle.loads(payload.numpy().tobytes())  # noqa: S301 - our own bytes


def _broadcast_rank(rank: int, port: int, iters: int, results) -> None:
    from worker_svc.parallel.distributed import ControlChannel, init_group

    torch.set_num_threads(1)
    tp = init_group(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    channel, group = ControlChannel(tp), tp.control_group
    methods = {
        "(barrier only)": (lambda m: None, lambda: None),  # the timing's own cost: subtract it
        "inline": (channel.send, channel.receive),
        "two-step": (lambda m: _two_step_send(m, group), lambda: _two_step_receive(group)),
        "object": (lambda m: dist.broadcast_object_list([m], src=0, group=group),
                   lambda: dist.broadcast_object_list([None], src=0, group=group)),
    }
    for plan_name, plan in sample_plans().items():
        for method, (send, receive) in methods.items():
            times = []
            for _ in range(iters):
                dist.barrier(group=group)
                start = time.perf_counter()
                send(plan) if rank == 0 else receive()
                dist.barrier(group=group)
                times.append(time.perf_counter() - start)
            if rank == 0:
                results[(plan_name, method)] = statistics.median(times)
    dist.destroy_process_group()


def measure_broadcast(iters: int) -> dict:
    from worker_svc.parallel.distributed import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_broadcast_rank, args=(free_port(), iters, results), nprocs=2, join=True)
        return dict(results)


def measure_steps(model: str, tp: int, batch_sizes: list[int], steps: int) -> dict[int, float]:
    from worker_svc.config import WorkerConfig
    from worker_svc.parallel.tp_worker import create_runner

    config = WorkerConfig(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=1024,
                          tensor_parallel_size=tp)
    runner = create_runner(config)
    runner.initialize()
    medians = {}
    try:
        for batch in batch_sizes:
            runner.reset()
            # 32 prompt tokens each, 3 blocks of 16 each: room for 16 decode steps.
            prefill = StepPlan(step_id=0, new_requests=[
                NewRequestData(RequestId(f"b{i}"), list(range(10, 42)), 32, [3 * i, 3 * i + 1, 3 * i + 2],
                               0, 32, SamplingParams(temperature=0.0, max_tokens=None))
                for i in range(batch)])
            runner.execute(prefill)
            times = []
            for step in range(1, min(steps, MAX_DECODE_STEPS) + 1):
                start = time.perf_counter()
                runner.execute(StepPlan(step_id=step))  # empty: every resident request +1 token
                times.append(time.perf_counter() - start)
            medians[batch] = statistics.median(times)
    finally:
        getattr(runner, "close", lambda: None)()
    return medians


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/pagoda-tiny")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--tp1-threads", type=int, default=None,
                   help="torch threads for TP=1 (default torch's: all cores; each TP=2 rank takes "
                        "cores/2). On a busy machine 1 avoids OpenMP contention distorting TP=1")
    args = p.parse_args(argv)
    if args.tp1_threads:
        torch.set_num_threads(args.tp1_threads)
    print("plan broadcast to 2 ranks (gloo, CPU), median per plan:")
    for (plan_name, method), seconds in measure_broadcast(args.iters).items():
        print(f"  {plan_name:24s} {method:15s} {seconds * 1e6:9.1f} us")
    step_times = {tp: measure_steps(args.model, tp, args.batch_sizes, args.steps) for tp in (1, 2)}
    print(f"decode step time, median of {args.steps} steps (tiny model, fp32, CPU):")
    for batch in args.batch_sizes:
        one, two = step_times[1][batch], step_times[2][batch]
        print(f"  batch {batch:4d}: TP=1 {one * 1e3:7.2f} ms   TP=2 {two * 1e3:7.2f} ms   "
              f"ratio {two / one:5.2f}")


if __name__ == "__main__":
    main()
