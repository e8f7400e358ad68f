"""Where a decode step's time goes at small batches: the parts of `benchmarks.plan_overhead --breakdown`.

1. In-process (`step_parts`): one decode step cut into the scheduler's schedule() and update(),
   the plan and result wire codec (protobuf encode + decode, as the gRPC round trip does it), and
   the worker's execute(): input building, the model's forward, logits, sampler, and the rest of
   execute (applying the plan, bookkeeping). Medians of wall time per step (perf_counter_ns).
2. Input building alone (`input_building`): the general builder against the decode buffers on the
   same decode-only sequences (300-token contexts), best of 5 x 200 calls: pure Python + numpy,
   so the figure a busy machine disturbs least.
3. Served (`served_cpu_per_token`): the whole stack (`pagoda.entrypoints.launcher`: gateway ->
   scheduler -> worker) streaming one request at a time, greedy, EOS ignored; CPU milliseconds
   each process spends per output token (psutil, user + system) beside TPOT. CPU time is what a
   process takes from the cores the forward's threads run on, and moves less than wall time when
   other processes share the machine.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import timeit
from pathlib import Path

import httpx
import psutil

from benchmarks import vllm_peer as peer
from benchmarks.serve_client import Endpoint, RequestSpec, send_request, served_model
from pagoda.contract import worker_codec as codec
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.v1 import worker_pb2

PARTS = ("schedule", "plan_codec", "build_inputs", "forward", "logits", "sampler", "rest_of_execute",
         "result_codec", "update")
SERVICES = ("gateway", "scheduler_svc", "worker_svc")


def timed_step(scheduler, runner, clock) -> tuple[object, object, dict[str, float]]:
    """One step through the services' path in one process (plan and result through their protobuf
    codecs): (plan, result, clock time of schedule / plan_codec / execute / result_codec / update)."""
    t0 = clock()
    plan = scheduler.schedule()
    t1 = clock()
    _, plan = codec.plan_from_pb(worker_pb2.StepPlan.FromString(codec.plan_to_pb(plan, 1).SerializeToString()))
    t2 = clock()
    result = runner.execute(plan)
    t3 = clock()
    result = codec.result_from_pb(worker_pb2.StepResult.FromString(codec.result_to_pb(result).SerializeToString()))
    t4 = clock()
    scheduler.update(result)
    t5 = clock()
    return plan, result, {"schedule": t1 - t0, "plan_codec": t2 - t1, "execute": t3 - t2,
                          "result_codec": t4 - t3, "update": t5 - t4}


def step_parts(model: str, batch: int, steps: int) -> dict[str, float]:
    """Median milliseconds of each part of a decode step with `batch` running requests."""
    from pagoda.entrypoints.llm import LLM
    from scheduler_svc.core.request import EngineRequest

    llm = LLM(model=model, device="cpu", dtype="float32", max_num_seqs=batch,
              num_gpu_blocks_override=batch * 48 + 8)
    scheduler, runner = llm.scheduler, llm.runner
    for i in range(batch):
        scheduler.add_request(EngineRequest(RequestId(f"b{i}"), tuple(range(4 + i, 36 + i)),
                                            SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)))
    for _ in range(4):  # prefill, then settle into decode
        scheduler.update(runner.execute(scheduler.schedule()))
    inner: dict[str, int] = {}
    _time_calls(runner, inner)
    clock = time.perf_counter_ns
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    for _ in range(steps):
        inner.clear()
        _, _, parts = timed_step(scheduler, runner, clock)
        parts["rest_of_execute"] = parts.pop("execute") - sum(inner.values())
        parts.update(inner)
        for part, ns in parts.items():
            times[part].append(ns / 1e6)
    llm.close()
    medians = {part: statistics.median(values) for part, values in times.items()}
    medians["step"] = sum(medians.values())
    return medians


def input_building(batches: list[int], block_size: int = 16) -> dict[int, dict[str, float]]:
    """ms per call of build_model_inputs and of DecodeInputBuffers.build, per decode batch size."""
    import torch

    from kernels import get_backend
    from worker_svc.input_batch import (
        CachedRequestState,
        DecodeInputBuffers,
        ScheduledSeq,
        build_model_inputs,
    )

    backend, cpu = get_backend("torch"), torch.device("cpu")
    buffers = DecodeInputBuffers(max(batches), 64, cpu)
    result = {}
    for batch in batches:
        seqs = [ScheduledSeq(CachedRequestState(RequestId(f"r{i}"), list(range(300 + i)), 32,
                                                list(range(i * 20, i * 20 + (300 + i) // block_size + 1)),
                                                299 + i, SamplingParams()), 1) for i in range(batch)]

        def best(fn) -> float:
            return min(timeit.repeat(fn, number=200, repeat=5)) / 200 * 1e3

        result[batch] = {"general": best(lambda seqs=seqs: build_model_inputs(seqs, block_size, backend, cpu)),
                         "buffers": best(lambda seqs=seqs: buffers.build(seqs, block_size, backend))}
    return result


def _time_calls(runner, inner: dict[str, int]) -> None:
    """Wrap the runner's parts (instance attributes, so only this runner is touched)."""
    def timed(name: str, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                inner[name] = inner.get(name, 0) + time.perf_counter_ns() - t0
        return call

    if hasattr(runner, "_build_inputs"):
        runner._build_inputs = timed("build_inputs", runner._build_inputs)
    else:  # a runner from before the decode buffers: the module-level builder
        import worker_svc.model_runner as model_runner

        model_runner.build_model_inputs = timed("build_inputs", model_runner.build_model_inputs)
    runner.model.forward = timed("forward", runner.model.forward)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    runner.sampler = timed("sampler", runner.sampler)


def served_cpu_per_token(model: str, num_requests: int, output_len: int, log_path: Path,
                         extra_flags: tuple[str, ...] = ()) -> dict:
    """One streamed request at a time through the launched stack; CPU ms per token per process."""
    ports = {name: peer.free_port() for name in ("http", "grpc", "scheduler", "worker")}
    argv = [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", model, "--device", "cpu",
            "--dtype", "float32", "--gateway-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
            "--scheduler-port", str(ports["scheduler"]), "--worker-port", str(ports["worker"]), *extra_flags]
    base_url = f"http://127.0.0.1:{ports['http']}"
    proc = peer.start_server(argv, None, log_path)
    try:
        peer.wait_ready(proc, base_url, timeout_s=300)
        return asyncio.run(_one_at_a_time(base_url, _services(proc.pid), num_requests, output_len))
    finally:
        peer.stop_server(proc)


def _services(launcher_pid: int) -> dict[str, psutil.Process]:
    found = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        command = " ".join(child.cmdline())
        for name in SERVICES:
            if f"-m {name}" in command:
                found[name] = child
    return found


def _cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}


async def _one_at_a_time(base_url: str, procs: dict[str, psutil.Process], num_requests: int,
                         output_len: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        endpoint = Endpoint(base_url, (await served_model(client, base_url))["id"])
        await send_request(client, endpoint, RequestSpec(list(range(5, 37)), 8))  # warm-up
        before, started = _cpu_seconds(procs), time.perf_counter()
        tokens, tpots = 0, []
        for i in range(num_requests):
            record = await send_request(client, endpoint, RequestSpec(list(range(10 + i, 42 + i)), output_len))
            if not record.success:
                raise RuntimeError(record.error)
            tokens += record.output_len
            tpots.append((record.chunk_times[-1] - record.chunk_times[0]) / (record.output_len - 1))
        wall = time.perf_counter() - started
        after = _cpu_seconds(procs)
    return {"output_tokens": tokens, "tpot_median_ms": statistics.median(tpots) * 1e3,
            "wall_ms_per_token": wall / tokens * 1e3,
            "cpu_ms_per_token": {name: (after[name] - before[name]) / tokens * 1e3 for name in procs}}
