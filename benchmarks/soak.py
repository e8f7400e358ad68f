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
after, and with `--rss-every N` every N requests (`rss_samples`, plotted by `--rss-plot`). Prints one JSON object; exits 1 if anything was lost, mishandled or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import grpc
import httpx
import psutil
from tqdm import tqdm

from benchmarks.soak_requests import Outcome, bad_request, completion
from pagoda.v1 import engine_pb2, engine_pb2_grpc


@dataclass(slots=True)
class SoakReport:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    lost: int = 0  # valid requests that neither completed nor were hung up (errors, 429/503 included)
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
    first_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        clean_engine = self.leaked_blocks in (None, 0) and self.worker_resident_requests in (None, 0)
        return self.lost == 0 and self.bad_mishandled == 0 and clean_engine and self.invariant_ok is not False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--scheduler", default=None, help="host:port of the Engine API for GetStats")
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


async def one_request(client: httpx.AsyncClient, args, rng: random.Random) -> Outcome:
    url = args.base_url.rstrip("/") + "/v1/completions"
    main_headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if rng.random() < args.bad_fraction:
        return await bad_request(client, url, main_headers, rng)
    quota = args.quota_api_key is not None and rng.random() < args.quota_fraction
    headers = {"authorization": f"Bearer {args.quota_api_key}"} if quota else main_headers
    body = {"prompt": [rng.randrange(1, args.vocab_size) for _ in range(args.prompt_len)],
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": rng.random() < args.stream_fraction}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    cancel = not quota and rng.random() < args.cancel_fraction
    early = cancel and (not body["stream"] or rng.random() < 0.5)  # hang up before the headers
    hang_up_after = rng.randrange(0, args.max_tokens) if cancel and not early else None
    timeout = rng.uniform(0.0, args.max_cancel_delay) if early else args.timeout
    try:
        return await asyncio.wait_for(completion(client, url, body, headers, hang_up_after=hang_up_after,
                                                 quota=quota), timeout)
    except TimeoutError:
        return Outcome("cancelled") if early else Outcome("lost", "timed out")
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


async def soak(args: argparse.Namespace) -> SoakReport:
    report = SoakReport()
    ports = [int(p) for p in args.rss_ports.split(",") if p]
    report.rss_mib_start = listener_rss_mib(ports)
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        slots = asyncio.Semaphore(args.concurrency)
        progress = tqdm(total=args.num_requests, desc="soak", unit="req", file=sys.stderr)

        async def bounded() -> None:
            async with slots:
                outcomes.append(await one_request(client, args, random.Random(rng.random())))
                progress.update()
                if args.rss_every and len(outcomes) % args.rss_every == 0:
                    report.rss_samples.append({"requests": len(outcomes), **listener_rss_mib(ports)})
                if outcomes[-1].kind == "lost":
                    progress.set_postfix(lost=sum(o.kind == "lost" for o in outcomes))

        await asyncio.gather(*(bounded() for _ in range(args.num_requests)))
        progress.close()
    report.wall_seconds = round(time.monotonic() - started, 3)
    report.sent = len(outcomes)
    counts = Counter(o.kind for o in outcomes)
    for kind in ("completed", "cancelled", "lost", "bad_rejected", "bad_mishandled", "over_quota"):
        setattr(report, kind, counts[kind])
    report.first_errors = [o.error for o in outcomes if o.error][:5]
    e2e = [o.e2e_seconds for o in outcomes if o.e2e_seconds is not None]
    ttft = [o.ttft_seconds for o in outcomes if o.ttft_seconds is not None]
    (e50, e99), (t50, t99) = percentiles(e2e), percentiles(ttft)
    report.latency_seconds = {"e2e_p50": e50, "e2e_p99": e99, "ttft_p50": t50, "ttft_p99": t99}
    if args.scheduler:
        stats = await wait_idle_stats(args.scheduler, args.idle_timeout)
        report.engine_idle, report.invariant_ok = stats.idle, stats.invariant_ok
        report.leaked_blocks = stats.num_used_blocks
        report.worker_resident_requests = stats.worker_resident_requests
    report.rss_mib_end = listener_rss_mib(ports)
    return report


def main(argv: list[str] | None = None) -> SoakReport:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    if args.rss_plot and report.rss_samples:
        from pathlib import Path

        from benchmarks.plots import plot_rss_samples

        plot_rss_samples(report.rss_samples, Path(args.rss_plot))
    print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
