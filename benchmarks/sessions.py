"""Multi-turn agent sessions with pauses between turns, the prefix cache's host tier off and on.

    python -m benchmarks.sessions [--model models/smollm2-135m-instruct] [--sessions 32] [--turns 6]
        [--first-len 1000] [--message-len 150:300] [--output-len 32] [--think-time 2]
        [--pool-sessions 4] [--kv-offloading-size 4] [--out benchmarks/results/sessions.json]

Each run starts the whole server (`python -m pagoda.entrypoints.launcher`, on free ports) with the
device KV pool sized (`--num-gpu-blocks-override`) to hold about `--pool-sessions` sessions at their
final length, once without and once with `--kv-offloading-size` GiB of host tier. N sessions run
concurrently; each sends `--turns` streamed completions, one after the other, its prompt the whole
history: the first message (`--first-len` tokens), then per turn a stand-in for the reply
(`--output-len` ids) and a new message. Between turns the client pauses (exponential think time,
mean `--think-time` s, seeded): that is when other sessions push its blocks out of the device pool.
Prompts are token ids (exact lengths), greedy, EOS ignored, so both runs do the same work.

Prints TTFT p50 / p99 of turns 2.. (turn 1 has nothing to hit), the prompt tokens served from the
cache, and prefill tokens computed (the scheduler's `pagoda:prefill_tokens_computed_total`) per
run, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.result_file import write_result
from benchmarks.scrape import parse_metrics
from benchmarks.serve_client import Endpoint, RequestSpec, send_request, served_model
from pagoda.runtime.math_utils import cdiv
from pagoda.tools.default_model import DEFAULT_OUT

PREFILL = "pagoda:prefill_tokens_computed"
OFFLOADED, LOADED = "pagoda:offloaded_blocks", "pagoda:offload_loaded_blocks"
BLOCK_SIZE = 16  # the worker's default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sessions", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_OUT))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=1000, help="tokens of a session's first message")
    p.add_argument("--message-len", default="150:300", help="MIN:MAX tokens of each later message")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--think-time", type=float, default=2.0, help="mean pause between turns, seconds")
    p.add_argument("--pool-sessions", type=float, default=4.0, help="device pool: this many final sessions")
    p.add_argument("--kv-offloading-size", type=float, default=4.0, help="GiB of host tier in the 'on' run")
    p.add_argument("--vocab", type=int, default=2000, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--extra-flag", action="append", default=[], help="passed to the launcher (repeatable)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sessions.json"))
    return p.parse_args(argv)


def plan_sessions(args: argparse.Namespace) -> list[list[list[int]]]:
    """Each session's prompts, turn by turn (the same in both runs)."""
    rng = random.Random(args.seed)
    low, high = (int(x) for x in args.message_len.split(":"))
    sessions = []
    for _ in range(args.sessions):
        history = [rng.randrange(10, args.vocab) for _ in range(args.first_len)]
        prompts = [list(history)]
        for _ in range(args.turns - 1):
            history += [rng.randrange(10, args.vocab) for _ in range(args.output_len)]  # the reply
            history += [rng.randrange(10, args.vocab) for _ in range(rng.randint(low, high))]
            prompts.append(list(history))
        sessions.append(prompts)
    return sessions


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(args: argparse.Namespace, num_blocks: int, offload_gib: float, log: Path):
    """The launcher on free ports; yields its base URL once /ready answers."""
    http = free_port()
    cmd = [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", args.model, "--dtype", args.dtype,
           "--num-gpu-blocks-override", str(num_blocks), "--gateway-port", str(http),
           "--grpc-port", str(free_port()), "--scheduler-port", str(free_port()),
           "--worker-port", str(free_port()), *args.extra_flag]
    if offload_gib:
        cmd += ["--kv-offloading-size", str(offload_gib)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{http}"
    try:
        end = time.monotonic() + args.startup_timeout
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the server did not start; see {log}")
            time.sleep(0.5)  # poll interval, bounded by the deadline
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    response = await client.get(f"{url}/metrics")
    return parse_metrics(response.text, (PREFILL, OFFLOADED, LOADED))


async def run_sessions(args: argparse.Namespace, url: str, sessions: list[list[list[int]]]) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        endpoint = Endpoint(url, (await served_model(client, url))["id"], timeout_s=1800.0)
        before = await metrics(client, url)
        records: list[tuple[int, object]] = []

        async def session(index: int, prompts: list[list[int]]) -> None:
            pauses = random.Random(args.seed * 1000 + index)
            for turn, prompt in enumerate(prompts):
                if turn:  # the person (or the tool call) takes a while: the client waits
                    await asyncio.sleep(pauses.expovariate(1 / args.think_time) if args.think_time else 0)
                record = await send_request(client, endpoint, RequestSpec(prompt, args.output_len))
                if not record.success:
                    raise RuntimeError(f"session {index} turn {turn + 1}: {record.error}")
                records.append((turn, record))

        started = time.perf_counter()
        await asyncio.gather(*(session(i, prompts) for i, prompts in enumerate(sessions)))
        duration = time.perf_counter() - started
        after = await metrics(client, url)
    later = sorted(r.ttft for turn, r in records if turn)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in (PREFILL, OFFLOADED, LOADED)}
    return {"ttft_p50_ms": round(1000 * statistics.median(later), 1),
            "ttft_p99_ms": round(1000 * percentile(later, 0.99), 1),
            "cached_tokens_later_turns": sum(r.cached_tokens for turn, r in records if turn),
            "prompt_tokens": sum(r.prompt_len for _, r in records),
            "prefill_tokens_computed": int(delta[PREFILL]), "blocks_offloaded": int(delta[OFFLOADED]),
            "blocks_loaded": int(delta[LOADED]), "duration_s": round(duration, 1)}


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sessions = plan_sessions(args)
    final_len = max(len(prompts[-1]) for prompts in sessions) + args.output_len
    num_blocks = int(args.pool_sessions * cdiv(final_len, BLOCK_SIZE))
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    results = {}
    for name, gib in (("host tier off", 0.0), ("host tier on", args.kv_offloading_size)):
        with server(args, num_blocks, gib, logs / f"sessions-{name.replace(' ', '-')}.log") as url:
            results[name] = asyncio.run(run_sessions(args, url, sessions))
    print(f"\n{args.sessions} sessions x {args.turns} turns, {args.model} ({args.dtype}), first message "
          f"{args.first_len} tokens, later {args.message_len}, {args.output_len} output tokens, think time "
          f"{args.think_time} s; device pool {num_blocks} blocks of {BLOCK_SIZE} (~{args.pool_sessions:g} "
          f"final sessions); {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    header = ("run", "TTFT p50 ms", "TTFT p99 ms", "cached (turns 2+)", "prefill computed", "loaded blocks")
    print(f"{header[0]:<15}" + "".join(f"{h:>19}" for h in header[1:]))
    for name, row in results.items():
        print(f"{name:<15}{row['ttft_p50_ms']:>19}{row['ttft_p99_ms']:>19}{row['cached_tokens_later_turns']:>19}"
              f"{row['prefill_tokens_computed']:>19}{row['blocks_loaded']:>19}")
    write_result(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "num_gpu_blocks": num_blocks,
                            **results})
    return results


if __name__ == "__main__":
    main()
