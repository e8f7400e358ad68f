"""Batch 1 served end to end: what the time between two forwards is spent on.

    .venv/bin/python -m benchmarks.step_timeline [--model models/gguf/smollm2-135m-instruct-Q8_0.gguf]
        [--requests 4] [--output-len 128] [--dtype auto] [--out FILE.json] [-- launcher flags ...]

Starts the whole stack (`pagoda.entrypoints.launcher`: gateway -> scheduler -> worker on loopback)
with `PAGODA_STEP_TIMELINE` set, so the worker and the scheduler write one line of timestamps per
step (pagoda/runtime/step_timeline.py; one clock for every process), then streams `--requests`
completions one at a time through the OpenAI API (greedy, EOS ignored, `--output-len` tokens).
Over the decode steps of those requests it prints medians (ms):

- TPOT p50 (the client's SSE chunk gaps) and the worker's step interval (step start to step start);
- forward: the model's forward and output layer (inputs built -> logits), as served;
- overhead = TPOT - forward, cut into the worker's parts (plan decode and checks, applying the plan
  and building the inputs, the sampler, the result proto, handing the result to gRPC, waiting for the
  next plan) and the scheduler's turnaround (result read -> update -> next plan written);
- pipelining: the share of steps whose next plan the scheduler had written before this step's
  forward ended (so the worker found it waiting);
- CPU ms per token of each process (psutil): on a 2-core machine what the gateway and the
  scheduler take, they take from the forward's threads.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import peer_server as peer
from benchmarks.result_file import write_result
from benchmarks.serve_client import Endpoint, RequestSpec, send_request, served_model
from benchmarks.step_breakdown import _cpu_seconds, _services
from pagoda.runtime.step_timeline import ENV, read_timelines

DEFAULT_MODEL = "models/gguf/smollm2-135m-instruct-Q8_0.gguf"
# (name, from mark, to mark) of consecutive worker instants; see WorkerServicer._record.
WORKER_PARTS = (("plan decode + checks", "started", "execute"), ("apply + build inputs", "execute", "inputs_built"),
                ("forward", "inputs_built", "logits_done"), ("sampler", "logits_done", "sampled"),
                ("result proto", "sampled", "encoded"), ("gRPC write handed over", "encoded", "written"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_timeline", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("launcher_flags", nargs="*", help="more launcher flags, after --")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    timeline_dir = Path(tempfile.mkdtemp(prefix="step_timeline_"))
    ports = {name: peer.free_port() for name in ("http", "grpc", "scheduler", "worker")}
    argv = [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", args.model, "--device", "cpu",
            "--dtype", args.dtype, "--gateway-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
            "--scheduler-port", str(ports["scheduler"]), "--worker-port", str(ports["worker"]),
            *args.launcher_flags]
    base_url = f"http://127.0.0.1:{ports['http']}"
    proc = peer.start_server(argv, {**os.environ, ENV: str(timeline_dir)}, timeline_dir / "launcher.log")
    try:
        peer.wait_ready(proc, base_url, timeout_s=900)  # a busy 2-core machine loads slowly
        client = asyncio.run(_one_at_a_time(base_url, _services(proc.pid), args.requests, args.output_len))
    finally:
        peer.stop_server(proc)
    result = analyse(read_timelines(timeline_dir, "worker"), read_timelines(timeline_dir, "scheduler"),
                     client["windows"])
    result.update(tpot_p50_ms=client["tpot_p50_ms"], cpu_ms_per_token=client["cpu_ms_per_token"],
                  wakeups_per_token=client["wakeups_per_token"],
                  output_tokens=client["output_tokens"], timeline_dir=str(timeline_dir))
    result["overhead_ms"] = result["tpot_p50_ms"] - result["worker_ms"]["forward"]
    return result


async def _one_at_a_time(base_url: str, procs: dict, num_requests: int, output_len: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        endpoint = Endpoint(base_url, (await served_model(client, base_url))["id"])
        await send_request(client, endpoint, RequestSpec(list(range(5, 37)), 8))  # warm-up
        before, switches, windows, gaps, tokens = _cpu_seconds(procs), _switches(procs), [], [], 0
        for i in range(num_requests):
            record = await send_request(client, endpoint, RequestSpec(list(range(10 + i, 42 + i)), output_len))
            if not record.success:
                raise RuntimeError(record.error)
            tokens += record.output_len
            windows.append((record.chunk_times[0], record.chunk_times[-1]))  # the request's decode steps
            gaps.append((record.chunk_times[-1] - record.chunk_times[0]) / (record.output_len - 1))
        after, switched = _cpu_seconds(procs), _switches(procs)
    return {"tpot_p50_ms": statistics.median(gaps) * 1e3, "windows": windows, "output_tokens": tokens,
            "cpu_ms_per_token": {name: (after[name] - before[name]) / tokens * 1e3 for name in procs},
            "wakeups_per_token": {name: (switched[name] - switches[name]) / tokens for name in procs}}


def _switches(procs: dict) -> dict[str, int]:
    """Voluntary context switches of every thread of each process (/proc: psutil counts the main
    thread's only): how often it went to sleep, so how often it woke and took a core."""
    counts = {}
    for name, proc in procs.items():
        total = 0
        for status in Path(f"/proc/{proc.pid}/task").glob("*/status"):
            try:
                total += next(int(line.split()[1]) for line in status.read_text().splitlines()
                              if line.startswith("voluntary_ctxt_switches"))
            except (FileNotFoundError, ProcessLookupError):
                pass  # a thread that ended meanwhile
        counts[name] = total
    return counts


def analyse(worker: list[dict], scheduler: list[dict], windows: list[tuple[float, float]]) -> dict:
    """Medians (ms) over the decode steps that ran inside the clients' streaming windows."""
    # Decode steps that ran a forward (a plan that only drops a finished request has no marks),
    # or every decode step of a --fake worker, which marks none.
    fake = not any("execute" in line for line in worker)
    steps = {line["step"]: line for line in worker if line.get("decode") and (fake or "execute" in line)}
    inside = sorted(s for s, line in steps.items()
                    if any(start <= line["started"] <= end for start, end in windows) and s + 1 in steps)
    plans = {line["step"]: line for line in scheduler}

    def median_ms(values) -> float:
        values = list(values)
        return statistics.median(values) * 1e3 if values else float("nan")

    def durations(a: str, b: str, after: int = 0) -> list[float]:  # b of step s + after minus a of step s
        return [steps[s + after][b] - steps[s][a] for s in inside if a in steps[s] and b in steps[s + after]]

    spans = {name: durations(a, b) for name, a, b in WORKER_PARTS}  # --fake: no marks, empty lists
    spans["waiting for the next plan"] = durations("written", "started", after=1)
    parts = {name: median_ms(values) for name, values in spans.items()}
    # Means too: on a busy machine a step loses a whole time slice in one part or another, which
    # the medians of the parts hide and the median of their sum does not.
    means = {name: statistics.fmean(values) * 1e3 if values else float("nan") for name, values in spans.items()}
    interval = median_ms(steps[s + 1]["started"] - steps[s]["started"] for s in inside)
    turnaround = [plans[s + 2]["sent"] - plans[s]["received"] for s in inside if s in plans and s + 2 in plans]
    early = [plans[s + 1]["sent"] < steps[s].get("logits_done", steps[s]["encoded"]) for s in inside if s + 1 in plans]
    return {"decode_steps": len(inside), "worker_interval_ms": interval, "worker_ms": parts, "worker_mean_ms": means,
            "scheduler_ms": {"result read -> next plan written": median_ms(turnaround),
                             "result read -> tokens dispatched": median_ms(
                                 plans[s]["dispatched"] - plans[s]["received"] for s in inside if s in plans)},
            "next_plan_waiting": sum(early) / len(early) if early else float("nan")}


def report(result: dict) -> None:
    print(f"decode steps measured: {result['decode_steps']}; {result['output_tokens']} output tokens")
    print(f"TPOT p50 {result['tpot_p50_ms']:.3f} ms   worker step interval p50 {result['worker_interval_ms']:.3f} ms   "
          f"forward p50 {result['worker_ms']['forward']:.3f} ms   overhead (TPOT - forward) "
          f"{result['overhead_ms']:.3f} ms")
    print("worker, per step (p50 / mean ms):")
    for name, ms in result["worker_ms"].items():
        print(f"   {name:28s} {ms:8.3f} / {result['worker_mean_ms'][name]:8.3f}")
    print("scheduler (p50 ms):")
    for name, ms in result["scheduler_ms"].items():
        print(f"   {name:34s} {ms:8.3f}")
    print(f"next plan already written when the forward ended: {result['next_plan_waiting']:.0%} of steps")
    print("CPU ms per output token: " + "  ".join(f"{name} {ms:.3f}" for name, ms in result["cpu_ms_per_token"].items()))
    print("wake-ups per output token: " + "  ".join(f"{name} {n:.1f}" for name, n in result["wakeups_per_token"].items()))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = run(args)
    result.update(model=args.model, started=started, load_average=os.getloadavg())
    report(result)
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
