"""Cancellation soak: many streamed requests, a fraction hung up at random moments; nothing may leak.

    python -m benchmarks.soak --base-url http://127.0.0.1:8000 --scheduler 127.0.0.1:50052 \
        --num-requests 10000 --cancel-fraction 0.2

Each request streams `/v1/completions` (greedy, `ignore_eos`, exactly `--max-tokens` tokens). A
cancelled one hangs up at a random moment: before the response headers (a random delay), or after
a random number of SSE chunks. Every other request must end with a finish_reason and `[DONE]` and
exactly `--max-tokens` tokens, else it counts as lost. With `--scheduler`, the script then waits for
the engine to be idle and reads GetStats: used blocks (leaked), the pool invariant and the number
of requests the worker still holds state for. Prints one JSON object; exits 1 if anything leaked
or was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

import grpc
import httpx

from pagoda.v1 import engine_pb2, engine_pb2_grpc


@dataclass(slots=True)
class SoakReport:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    lost: int = 0  # not cancelled, yet not completed with every token (errors included)
    rejected: int = 0  # 429 / 503 answered before any token (counted as lost too)
    wall_seconds: float = 0.0
    engine_idle: bool | None = None
    invariant_ok: bool | None = None
    leaked_blocks: int | None = None  # used blocks once idle
    worker_resident_requests: int | None = None
    first_errors: list[str] | None = None

    @property
    def ok(self) -> bool:
        clean_engine = self.leaked_blocks in (None, 0) and self.worker_resident_requests in (None, 0)
        return self.lost == 0 and clean_engine and self.invariant_ok is not False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--scheduler", default=None, help="host:port of the Engine API for GetStats")
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=24, help="prompt length in token ids")
    p.add_argument("--max-cancel-delay", type=float, default=0.05,
                   help="seconds: upper bound of the random delay of a hang-up before headers")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="seconds to wait for idle")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def _read_stream(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None
                       ) -> tuple[bool, str]:
    """(completed, error). `hang_up_after`: close the connection after that many chunks."""
    tokens, finished, done, chunks = 0, False, False, 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return False, f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks += 1
            if hang_up_after is not None and chunks > hang_up_after:
                return False, "hung up"  # leaving the block closes the connection
            event = json.loads(line[6:])
            if "error" in event:
                return False, f"error chunk: {event['error']}"
            for choice in event.get("choices", []):
                finished = finished or choice.get("finish_reason") is not None
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not (done and finished and tokens == body["max_tokens"]):
        return False, f"incomplete: done={done} finished={finished} tokens={tokens}"
    return True, ""


async def one_request(client: httpx.AsyncClient, args, index: int, rng: random.Random,
                      report: SoakReport, errors: list[str]) -> None:
    prompt = [rng.randrange(1, 1000) for _ in range(args.prompt_len)]
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    cancel = rng.random() < args.cancel_fraction
    early = cancel and rng.random() < 0.5  # half before headers, half mid-stream
    hang_up_after = rng.randrange(0, args.max_tokens) if cancel and not early else None
    url = args.base_url.rstrip("/") + "/v1/completions"
    report.sent += 1
    try:
        timeout = rng.uniform(0.0, args.max_cancel_delay) if early else args.timeout
        completed, error = await asyncio.wait_for(_read_stream(client, url, body, hang_up_after), timeout)
    except TimeoutError:
        completed, error = False, "hung up" if early else "timed out"
    except httpx.HTTPError as exc:
        completed, error = False, f"{type(exc).__name__}: {exc}"
    if cancel:
        report.cancelled += 1
    elif completed:
        report.completed += 1
    else:
        report.lost += 1
        report.rejected += error.startswith("HTTP 429") or error.startswith("HTTP 503")
        if len(errors) < 5:
            errors.append(f"request {index}: {error}")


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
    report, errors = SoakReport(), []
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        slots = asyncio.Semaphore(args.concurrency)

        async def bounded(index: int) -> None:
            async with slots:
                await one_request(client, args, index, random.Random(rng.random()), report, errors)

        await asyncio.gather(*(bounded(i) for i in range(args.num_requests)))
    report.wall_seconds = round(time.monotonic() - started, 3)
    report.first_errors = errors
    if args.scheduler:
        stats = await wait_idle_stats(args.scheduler, args.idle_timeout)
        report.engine_idle, report.invariant_ok = stats.idle, stats.invariant_ok
        report.leaked_blocks = stats.num_used_blocks
        report.worker_resident_requests = stats.worker_resident_requests
    return report


def main(argv: list[str] | None = None) -> SoakReport:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
