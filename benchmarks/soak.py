"""Soak: many requests of every kind through the gateway; nothing may be lost, leak or grow.

    python -m benchmarks.soak --base-url http://127.0.0.1:8000 --scheduler 127.0.0.1:50052 \
        --num-requests 10000 --cancel-fraction 0.2 --stream-fraction 0.5 --bad-fraction 0.03 \
        --quota-api-key sk-tight --quota-fraction 0.05 --api-key sk-main --rss-ports 8000,50052,50061 \
        --rss-every 500 --rss-plot docs/img/soak_rss.png

Request kinds (benchmarks/soak_requests.py): normal completions (greedy, `ignore_eos`, exactly
`--max-tokens` tokens; streamed or not; `--cancel-fraction` of them hung up at a random moment),
malformed bodies (must get a 4xx in the OpenAI error shape) and requests under a tight tenant quota
(complete, or 429 with the rate-limit headers). A normal request that does not complete counts as
lost. With `--scheduler`, once the load is over the script waits for the engine to be idle and
reads GetStats: used blocks (leaked), the pool invariant and the requests the worker still holds.
With `--rss-ports`, the resident memory of the processes listening on those ports, before and
after, and with `--rss-every N` every N requests (`rss_samples`, plotted by `--rss-plot`).

Faults (issue 32): on data-parallel replicas (`make run DP=2`), `--scheduler` names every replica's
Engine API and `--workers` their workers, in the same order; `--fault-schedule
"worker:300,scheduler:700,drain:1100"` (or `--fault-every N`) kills a worker, kills a scheduler or
drains and restarts a replica while the traffic flows (benchmarks/soak_faults.py), each fault
logged with its request index, time and recovery (`faults`). `--expected after` (or `before`)
then checks every greedy request's text against a pass with no fault (benchmarks/soak_expected.py):
`mismatched` counts the completed requests whose text differs and the hung-up streams whose text so
far is not a prefix of it. Idle stats are read from every replica and summed.

Prints one JSON object; exits 1 if anything was lost, failed, mismatched, mishandled or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import httpx
import psutil
from tqdm import tqdm

from benchmarks import soak_expected
from benchmarks.soak_faults import FaultInjector, events_as_dicts, parse_schedule
from benchmarks.soak_requests import Outcome, PlannedRequest, bad_request, completion, plan_request
from pagoda.v1 import engine_pb2, engine_pb2_grpc


@dataclass(slots=True)
class SoakReport:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0  # valid requests the server failed: a status other than 200 (429/503 included),
    # an error chunk in the stream, a wrong token count
    lost: int = 0  # valid requests with no final answer: timed out, connection broken, stream cut short
    mismatched: int | None = None  # with --expected: texts that differ from the undisturbed pass
    mismatch_examples: list[dict] = field(default_factory=list)
    expected_seconds: float | None = None  # the undisturbed pass's wall time
    faults: list[dict] = field(default_factory=list)  # with --fault-schedule: what was done, when
    bad_rejected: int = 0  # malformed bodies refused with a 4xx in the OpenAI shape
    bad_mishandled: int = 0  # malformed bodies answered otherwise (2xx, 5xx, another shape)
    over_quota: int = 0  # quota-tenant requests refused with 429 + rate-limit headers
    wall_seconds: float = 0.0
    latency_seconds: dict[str, float] = field(default_factory=dict)  # e2e / TTFT p50 and p99
    rss_mib_start: dict[str, float] = field(default_factory=dict)  # by listening port
    rss_mib_end: dict[str, float] = field(default_factory=dict)
    # With --rss-every N: {"requests": done, port: MiB, ...} every N finished requests (a flat line
    # is the acceptance of issue 32: worker, scheduler and gateway within 5% from 2,000 on)
    rss_samples: list[dict[str, float]] = field(default_factory=list)
    engine_idle: bool | None = None
    invariant_ok: bool | None = None
    leaked_blocks: int | None = None  # used blocks once idle
    worker_resident_requests: int | None = None
    replicas: list[dict] = field(default_factory=list)  # each scheduler's idle stats, when several
    first_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        clean_engine = self.leaked_blocks in (None, 0) and self.worker_resident_requests in (None, 0)
        faults_ok = not any(f["error"] for f in self.faults)
        return (self.lost == 0 and self.failed == 0 and self.mismatched in (None, 0) and faults_ok
                and self.bad_mishandled == 0 and clean_engine and self.invariant_ok is not False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--scheduler", default=None,
                   help="host:port of the Engine API for GetStats; comma-separated: every replica's")
    p.add_argument("--workers", default="",
                   help="comma-separated worker ports of the replicas, in --scheduler's order (faults)")
    p.add_argument("--fault-schedule", default="",
                   help='faults as KIND[@REPLICA]:REQUEST,... (KIND: worker, scheduler, drain)')
    p.add_argument("--fault-every", type=int, default=0, help="a fault every N requests, cycling --fault-kinds")
    p.add_argument("--fault-kinds", default="worker,scheduler,drain")
    p.add_argument("--fault-timeout", type=float, default=180.0, help="seconds a replica may take to recover")
    p.add_argument("--expected", choices=("none", "before", "after"), default="none",
                   help="check greedy texts against an undisturbed pass, run before or after the soak")
    p.add_argument("--expected-file", default=None, help="keep / reuse the undisturbed texts here (JSON)")
    p.add_argument("--expected-batch", type=int, default=32, help="prompts per call of the undisturbed pass")
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--stream-fraction", type=float, default=1.0, help="of the normal requests")
    p.add_argument("--bad-fraction", type=float, default=0.0, help="malformed bodies")
    p.add_argument("--api-key", default=None, help="the key of the normal requests")
    p.add_argument("--quota-api-key", default=None, help="a key whose tenant has tight limits")
    p.add_argument("--quota-fraction", type=float, default=0.0, help="requests sent with it")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=24, help="prompt length in token ids")
    p.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids are drawn below it")
    p.add_argument("--max-cancel-delay", type=float, default=0.05,
                   help="seconds: upper bound of the random delay of a hang-up before headers")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="seconds to wait for idle")
    p.add_argument("--rss-ports", default="", help="comma-separated ports whose listeners' RSS to report")
    p.add_argument("--rss-every", type=int, default=0, help="sample --rss-ports every N finished requests")
    p.add_argument("--rss-plot", default=None, help="PNG of the RSS samples (benchmarks/plots.py)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def one_request(client: httpx.AsyncClient, args, planned: PlannedRequest) -> Outcome:
    url = args.base_url.rstrip("/") + "/v1/completions"
    main_headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if planned.kind == "bad":
        return await bad_request(client, url, main_headers, planned.bad)
    quota = planned.kind == "quota"
    headers = {"authorization": f"Bearer {args.quota_api_key}"} if quota else main_headers
    timeout = planned.cancel_delay if planned.cancel_early else args.timeout
    try:
        return await asyncio.wait_for(completion(client, url, planned.body, headers,
                                                 hang_up_after=planned.hang_up_after, quota=quota), timeout)
    except TimeoutError:
        return Outcome("cancelled") if planned.cancel_early else Outcome("lost", "timed out")
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body or SSE line that is not JSON
        return Outcome("lost", f"{type(exc).__name__}: {exc}")


def listener_rss_mib(ports: list[int]) -> dict[str, float]:
    """{port: RSS in MiB} of the processes listening on `ports` (those found)."""
    pids = {c.laddr.port: c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports and c.pid}
    return {str(port): round(psutil.Process(pid).memory_info().rss / 2**20, 1) for port, pid in pids.items()}


def percentiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return round(cuts[49], 4), round(cuts[98], 4)


async def wait_idle_stats(target: str, timeout_s: float) -> engine_pb2.EngineStats:
    """GetStats once the engine is idle and the worker has reported dropping every request."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        end = time.monotonic() + timeout_s
        while True:
            stats = await stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
            settled = stats.idle and stats.num_used_blocks == 0 and stats.worker_resident_requests == 0
            if settled or time.monotonic() > end:
                return stats
            await asyncio.sleep(0.05)  # poll interval; bounded by timeout_s


async def expected_texts(client: httpx.AsyncClient, args, plans: list[PlannedRequest]) -> dict[int, str]:
    key = {"base_url": args.base_url, "seed": args.seed, "num_requests": args.num_requests,
           "prompt_len": args.prompt_len, "vocab_size": args.vocab_size, "max_tokens": args.max_tokens,
           "model": (await client.get(args.base_url.rstrip("/") + "/v1/models")).json()["data"][0]["id"]}
    path = Path(args.expected_file) if args.expected_file else None
    if (texts := soak_expected.load(path, key)) is None:
        bodies = {i: p.body for i, p in enumerate(plans) if p.body is not None}
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        texts = await soak_expected.reference_texts(client, args.base_url.rstrip("/") + "/v1/completions",
                                                    headers, bodies, args.expected_batch)
        soak_expected.save(path, key, texts)
    return texts


async def idle_stats(args, report: SoakReport) -> None:
    """Every replica's stats once idle: leaked blocks, resident requests (summed), the invariant (all)."""
    targets = [t for t in args.scheduler.split(",") if t]
    every = [await wait_idle_stats(t, args.idle_timeout) for t in targets]
    report.engine_idle = all(s.idle for s in every)
    report.invariant_ok = all(s.invariant_ok for s in every)
    report.leaked_blocks = sum(s.num_used_blocks for s in every)
    report.worker_resident_requests = sum(s.worker_resident_requests for s in every)
    if len(every) > 1:
        report.replicas = [{"scheduler": t, "idle": s.idle, "invariant_ok": s.invariant_ok,
                            "leaked_blocks": s.num_used_blocks, "worker_resident_requests": s.worker_resident_requests,
                            "num_preemptions": s.num_preemptions, "request_success": dict(s.request_success)}
                           for t, s in zip(targets, every, strict=True)]


async def soak(args: argparse.Namespace) -> SoakReport:
    report = SoakReport()
    ports = [int(p) for p in args.rss_ports.split(",") if p]
    report.rss_mib_start = listener_rss_mib(ports)
    plans = [plan_request(i, args) for i in range(args.num_requests)]
    injector = fault_injector(args)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    outcomes: list[Outcome | None] = [None] * args.num_requests
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        expected = await timed_expected(client, args, plans, report) if args.expected == "before" else None
        started = time.monotonic()
        done = 0
        slots = asyncio.Semaphore(args.concurrency)
        progress = tqdm(total=args.num_requests, desc="soak", unit="req", file=sys.stderr)

        async def bounded(index: int) -> None:
            nonlocal done
            async with slots:
                if injector is not None:
                    await injector.sent(index)
                outcome = outcomes[index] = await one_request(client, args, plans[index])
                done += 1
                progress.update()
                if args.rss_every and done % args.rss_every == 0:
                    report.rss_samples.append({"requests": done, **listener_rss_mib(ports)})
                if outcome.kind in ("lost", "failed"):
                    progress.set_postfix(lost=sum(o is not None and o.kind == "lost" for o in outcomes),
                                         failed=sum(o is not None and o.kind == "failed" for o in outcomes))

        faults = asyncio.create_task(injector.run()) if injector is not None else None
        if injector is not None:
            injector.started = started
        await asyncio.gather(*(bounded(i) for i in range(args.num_requests)))
        progress.close()
        report.wall_seconds = round(time.monotonic() - started, 3)
        if faults is not None:
            await faults  # a fault due at the last requests may still be recovering
            report.faults = events_as_dicts(injector.events)
        if args.expected == "after":
            expected = await timed_expected(client, args, plans, report)
    tally(report, outcomes, expected)
    if args.scheduler:
        await idle_stats(args, report)
    report.rss_mib_end = listener_rss_mib(ports)
    return report


def fault_injector(args: argparse.Namespace) -> FaultInjector | None:
    if not (args.fault_schedule or args.fault_every):
        return None
    schedulers = [t for t in (args.scheduler or "").split(",") if t]
    workers = [w.rpartition(":")[2] for w in args.workers.split(",") if w]
    if not schedulers or len(workers) != len(schedulers):
        raise SystemExit("faults need --scheduler and --workers for every replica, in the same order")
    replicas = [(int(w), int(t.rpartition(":")[2])) for w, t in zip(workers, schedulers, strict=True)]
    faults = parse_schedule(args.fault_schedule, args.fault_every, args.fault_kinds, args.num_requests,
                            len(replicas))
    if late := [f for f in faults if f.at_request >= args.num_requests]:
        raise SystemExit(f"faults after the last request: {late}")
    return FaultInjector(faults, replicas, time.monotonic(), args.fault_timeout)


async def timed_expected(client, args, plans, report: SoakReport) -> dict[int, str]:
    started = time.monotonic()
    texts = await expected_texts(client, args, plans)
    report.expected_seconds = round(time.monotonic() - started, 3)
    return texts


def tally(report: SoakReport, outcomes: list[Outcome], expected: dict[int, str] | None) -> None:
    report.sent = len(outcomes)
    counts = Counter(o.kind for o in outcomes)
    for kind in ("completed", "cancelled", "failed", "lost", "bad_rejected", "bad_mishandled", "over_quota"):
        setattr(report, kind, counts[kind])
    report.first_errors = [o.error for o in outcomes if o.error][:5]
    if expected is not None:
        wrong = soak_expected.mismatches(outcomes, expected)
        report.mismatched, report.mismatch_examples = len(wrong), wrong[:5]
    e2e = [o.e2e_seconds for o in outcomes if o.e2e_seconds is not None]
    ttft = [o.ttft_seconds for o in outcomes if o.ttft_seconds is not None]
    (e50, e99), (t50, t99) = percentiles(e2e), percentiles(ttft)
    report.latency_seconds = {"e2e_p50": e50, "e2e_p99": e99, "ttft_p50": t50, "ttft_p99": t99}


def main(argv: list[str] | None = None) -> SoakReport:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    if args.rss_plot and report.rss_samples:
        from benchmarks.plots import plot_rss_samples

        plot_rss_samples(report.rss_samples, Path(args.rss_plot))
    print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
