"""Two tenants, one flooding: the light tenant's TTFT alone, and beside the flood with the tenant
policies off and on (VTC fair-share admission + a per-tenant KV cap).

    python -m benchmarks.tenants [--model models/pagoda-tiny] [--num-blocks 512]
        [--flood-requests 64] [--flood-len 512] [--flood-output 128]
        [--light-requests 20] [--light-len 64] [--light-output 16] [--light-gap 0.25]
        [--kv-share 0.5] [--out benchmarks/results/tenants.json]

One worker (`--num-gpu-blocks-override --num-blocks`, blocks of 16 tokens) serves every run; each
run starts its own scheduler (the run's flags) and gateway (a keys file of two tenants) on free
ports. The flood tenant sends
`--flood-requests` long streamed completions at once; a second later the light tenant sends
`--light-requests` short ones, one after the other `--light-gap` s apart. When the light tenant is
done the flood is cancelled (its requests aborted). Prompts are token ids, greedy, EOS ignored.
Runs: the light tenant alone; beside the flood with the scheduler's defaults (FCFS across tenants,
no cap); beside the flood with `--tenant-fairness vtc --tenant-kv-share F`. Prints the light
tenant's TTFT p50 / p99 per run and p99 / p99 alone, and the flood's largest KV block count seen on
/metrics, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from benchmarks.peer_server import free_port, start_server, stop_server
from benchmarks.result_file import write_result
from benchmarks.serve_client import Endpoint, RequestSpec, send_request, served_model
from benchmarks.sessions import percentile

KEYS = [{"key": "sk-flood", "tenant": "flood"}, {"key": "sk-light", "tenant": "light"}]
RUNS = (("alone", False, []), ("flood, policies off", True, []),
        ("flood, VTC + cap", True, ["--tenant-fairness", "vtc", "--tenant-kv-share"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tenants", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pagoda-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-blocks", type=int, default=512, help="the device pool, blocks of 16 tokens")
    p.add_argument("--flood-requests", type=int, default=64)
    p.add_argument("--flood-len", type=int, default=512)
    p.add_argument("--flood-output", type=int, default=128)
    p.add_argument("--light-requests", type=int, default=20)
    p.add_argument("--light-len", type=int, default=64)
    p.add_argument("--light-output", type=int, default=16)
    p.add_argument("--light-gap", type=float, default=0.25, help="seconds between light requests")
    p.add_argument("--head-start", type=float, default=1.0, help="seconds the flood starts before")
    p.add_argument("--kv-share", type=float, default=0.5, help="--tenant-kv-share in the policies-on run")
    p.add_argument("--vocab", type=int, default=2000, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/tenants.json"))
    return p.parse_args(argv)


async def flood_held(client: httpx.AsyncClient, url: str, seen: list[float]) -> None:
    """The flood tenant's KV blocks on /metrics, polled until cancelled (the largest is kept)."""
    while True:
        for line in (await client.get(f"{url}/metrics")).text.splitlines():
            if line.startswith("pagoda:tenant_kv_blocks{") and 'tenant="flood"' in line:
                seen.append(float(line.rsplit(" ", 1)[1]))
        await asyncio.sleep(0.05)  # poll interval


async def run(args: argparse.Namespace, url: str, with_flood: bool) -> dict:
    rng = random.Random(args.seed)
    prompt = lambda n: [rng.randrange(10, args.vocab) for _ in range(n)]  # noqa: E731
    flood_specs = [RequestSpec(prompt(args.flood_len), args.flood_output) for _ in range(args.flood_requests)]
    light_specs = [RequestSpec(prompt(args.light_len), args.light_output) for _ in range(args.light_requests)]
    auth = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731
    async with httpx.AsyncClient(timeout=None, headers=auth("sk-flood")) as flood_client, \
            httpx.AsyncClient(timeout=None, headers=auth("sk-light")) as light_client:
        endpoint = Endpoint(url, (await served_model(light_client, url))["id"], timeout_s=1800.0)
        seen: list[float] = []
        background = [asyncio.create_task(flood_held(light_client, url, seen))]
        if with_flood:
            background += [asyncio.create_task(send_request(flood_client, endpoint, s)) for s in flood_specs]
            await asyncio.sleep(args.head_start)  # the flood is queued and running first
        records = []
        for spec in light_specs:
            record = await send_request(light_client, endpoint, spec)
            if not record.success:
                raise RuntimeError(f"a light request failed: {record.error}")
            records.append(record)
            await asyncio.sleep(args.light_gap)  # the light tenant's pace
        for task in background:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*background, return_exceptions=True)
    ttfts = sorted(r.ttft for r in records)
    return {"light_ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "light_ttft_p99_ms": round(1000 * percentile(ttfts, 0.99), 1),
            "flood_max_kv_blocks": max(seen, default=0.0)}


@contextlib.contextmanager
def child(module: str, argv: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """`python -m module argv...`, its output in `log`; terminated (then killed) on exit."""
    proc = start_server([sys.executable, "-m", module, *argv], dict(os.environ), log)
    try:
        yield proc
    finally:
        stop_server(proc)


def wait_for(check: Callable[[], bool], proc: subprocess.Popen, what: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"{what} did not start (see its log under $TMPDIR)")
        time.sleep(0.5)  # poll interval, bounded by the deadline


def ready(url: str) -> bool:
    """The gateway's /ready (no API key needed, unlike /v1/models with --api-keys)."""
    try:
        return httpx.get(f"{url}/ready", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    results = {}
    worker_port = free_port()
    worker_argv = ["--model", args.model, "--dtype", args.dtype, "--port", str(worker_port),
                   "--num-gpu-blocks-override", str(args.num_blocks)]
    with tempfile.TemporaryDirectory() as tmp, child("worker_svc", worker_argv, logs / "tenants-worker.log") as worker:
        keys = Path(tmp) / "keys.jsonl"
        keys.write_text("".join(json.dumps(entry) + "\n" for entry in KEYS))
        wait_for(lambda: listening(worker_port), worker, "the worker", args.startup_timeout)
        for name, with_flood, flags in RUNS:
            flags = [*flags, str(args.kv_share)] if flags else []
            tag = name.replace(" ", "-").replace(",", "").replace("+", "and")
            scheduler_port, http_port = free_port(), free_port()
            url = f"http://127.0.0.1:{http_port}"
            with child("scheduler_svc", ["--workers", f"127.0.0.1:{worker_port}", "--port", str(scheduler_port),
                                         *flags], logs / f"tenants-scheduler-{tag}.log"), \
                    child("gateway", ["--scheduler", f"127.0.0.1:{scheduler_port}", "--port", str(http_port),
                                      "--grpc-port", str(free_port()), "--tokenizer", args.model,
                                      "--api-keys", str(keys)], logs / f"tenants-gateway-{tag}.log") as gateway:
                wait_for(lambda url=url: ready(url), gateway, "the gateway", args.startup_timeout)
                results[name] = asyncio.run(run(args, url, with_flood))
    alone = results["alone"]["light_ttft_p99_ms"]
    print(f"\nlight tenant: {args.light_requests} x {args.light_len}+{args.light_output} tokens, "
          f"{args.light_gap} s apart; flood: {args.flood_requests} x {args.flood_len}+{args.flood_output} "
          f"at once; {args.model} ({args.dtype}), pool {args.num_blocks} blocks of 16; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'run':<22}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}{'p99 / alone':>14}{'flood max blocks':>18}")
    for name, row in results.items():
        row["p99_vs_alone"] = round(row["light_ttft_p99_ms"] / alone, 2) if alone else None
        print(f"{name:<22}{row['light_ttft_p50_ms']:>14}{row['light_ttft_p99_ms']:>14}"
              f"{row['p99_vs_alone']:>14}{row['flood_max_kv_blocks']:>18g}")
    write_result(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, **results})
    return results


if __name__ == "__main__":
    main()
