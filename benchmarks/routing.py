"""Prefix-aware routing vs round-robin over data-parallel replicas (issue 19, acceptance 1).

    python -m benchmarks.routing [--model models/pagoda-tiny | --fake] [--replicas 2] \
        [--num-prompts 128] [--num-prefixes 8] [--request-rate 16] [--num-blocks 256] [--out F.json]

Starts `--replicas` worker + scheduler pairs on free loopback ports, then one gateway per policy
over all of them (prefix, round-robin, least-loaded) and one gateway over replica 0 alone (the
single-replica reference), and sends each the same prefix-repetition workload (benchmarks.datasets:
`--num-prefixes` system prompts × many users) in a shuffled order (the dataset cycles through the
prefixes, which round-robin over an even replica count would follow by accident), at a Poisson
`--request-rate`. Every run carries a cache salt of its own, so no run finds another's blocks.
Prints, per policy: the prefix hit rate (cached prompt tokens / prompt tokens, from each response's
usage.prompt_tokens_details.cached_tokens), its ratio to the single replica's, TTFT p50 / p99,
output throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from benchmarks.datasets import WorkloadSpec, make_workload
from benchmarks.result_file import write_result
from benchmarks.serve_client import Endpoint, RequestSpec, send_request
from benchmarks.serve_metrics import arrival_intervals, compute_metrics
from pagoda.runtime.healthcheck import check_serving

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("prefix", "round-robin", "least-loaded")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/pagoda-tiny", help="the workers' model (its tokenizer too)")
    p.add_argument("--fake", action="store_true", help="fake workers: hit rates only, no compute to save")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=16.0)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Children started here, stopped (SIGTERM, then SIGKILL) in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.procs = log_dir, []

    def start(self, name: str, *argv: str) -> None:
        log = open(self.log_dir / f"{name}.log", "w")
        self.procs.append(subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=log,
                                           stderr=subprocess.STDOUT))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_until(predicate, what: str, procs: Processes, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if any(p.poll() is not None for p in procs.procs):
            raise SystemExit(f"a child exited while waiting for {what}: see {procs.log_dir}")
        if time.monotonic() > end:
            raise SystemExit(f"{what} not ready after {deadline_s:.0f}s")
        time.sleep(0.2)  # poll interval; bounded by the deadline


def http_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def start_stack(args: argparse.Namespace, procs: Processes) -> dict[str, str]:
    """Workers, schedulers, and the gateways: {label: base URL}."""
    model = ["--fake", "--model", args.model] if args.fake else ["--model", args.model]
    schedulers = []
    for i in range(args.replicas):
        worker_port, scheduler_port = free_port(), free_port()
        procs.start(f"worker{i}", "worker_svc", *model, "--port", str(worker_port), "--device", "cpu",
                    "--num-gpu-blocks-override", str(args.num_blocks))
        procs.start(f"scheduler{i}", "scheduler_svc", "--workers", f"127.0.0.1:{worker_port}",
                    "--port", str(scheduler_port))
        schedulers.append(f"127.0.0.1:{scheduler_port}")
    for target in schedulers:
        wait_until(lambda t=target: check_serving(t, timeout_s=1.0)[0], target, procs)
    gateways = {"1 replica": [schedulers[0]]}
    gateways |= {policy: schedulers for policy in args.policies.split(",")}
    urls = {}
    for label, targets in gateways.items():
        port = free_port()
        policy = ["--routing-policy", label] if label in POLICIES else []
        procs.start(f"gateway-{label.replace(' ', '-')}", "gateway", "--scheduler", ",".join(targets),
                    "--port", str(port), "--grpc-port", str(free_port()), "--tokenizer", args.model,
                    "--log-json", *policy)
        urls[label] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        wait_until(lambda u=url: http_ready(u), url, procs)
    return urls


def workload(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    spec = WorkloadSpec(dataset="prefix-repetition", num_prompts=args.num_prompts, vocab_size=vocab_size,
                        seed=args.seed, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                        suffix_len=args.suffix_len, output_len=args.output_len)
    items = make_workload(spec)
    random.Random(args.seed).shuffle(items)  # users arrive in any order, not prefix by prefix
    return [RequestSpec(i.prompt_token_ids, i.max_tokens, None) for i in items]


async def run(client: httpx.AsyncClient, url: str, model: str, requests: list[RequestSpec],
              rate: float, seed: int) -> dict:
    endpoint = Endpoint(url, model, "completions", 300.0)
    salt = f"routing-{secrets.token_hex(6)}"
    intervals = arrival_intervals(len(requests), rate, 1.0, seed)
    started = time.perf_counter()
    tasks = []
    for index, spec in enumerate(requests):
        if index and intervals[index - 1] > 0:
            await asyncio.sleep(intervals[index - 1])
        tasks.append(asyncio.create_task(send_request(client, endpoint, replace(spec, cache_salt=salt))))
    records = await asyncio.gather(*tasks)
    metrics = compute_metrics(records, time.perf_counter() - started)
    done = [r for r in records if r.success]
    prompt = sum(r.prompt_len for r in done)
    return {"completed": metrics.completed, "failed": metrics.failed,
            "hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
            "ttft_p50_ms": metrics.ttft.median_s * 1e3, "ttft_p99_ms": metrics.ttft.p99_s * 1e3,
            "output_tok_s": metrics.output_throughput}


async def benchmark(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, dict]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        card = (await client.get(f"{urls['1 replica']}/v1/models")).json()["data"][0]
        requests = workload(args, int(card.get("vocab_size") or 2048))
        for url in urls.values():  # one warm-up request each (salted apart from the runs)
            await send_request(client, Endpoint(url, card["id"], "completions", 300.0),
                               replace(requests[0], max_tokens=2, cache_salt=secrets.token_hex(6)))
        return {label: await run(client, url, card["id"], requests, args.request_rate, args.seed)
                for label, url in urls.items()}


def table(args: argparse.Namespace, results: dict[str, dict]) -> str:
    reference = results["1 replica"]["hit_rate"] or 1.0
    rows = [f"{args.num_prompts} requests, {args.num_prefixes} prefixes x {args.prefix_len} tokens + "
            f"{args.suffix_len}, {args.output_len} out, {args.request_rate} req/s, "
            f"{'fake workers' if args.fake else args.model}, {args.num_blocks} KV blocks/replica",
            f"{'routing':<16}{'ok':>5}{'hit rate':>10}{'vs 1 rep.':>11}{'TTFT p50':>11}{'TTFT p99':>11}"
            f"{'out tok/s':>11}"]
    for label, r in results.items():
        name = label if label == "1 replica" else f"{args.replicas} x {label}"
        rows.append(f"{name:<16}{r['completed']:>5}{r['hit_rate']:>10.3f}{r['hit_rate'] / reference:>11.2f}"
                    f"{r['ttft_p50_ms']:>9.1f}ms{r['ttft_p99_ms']:>9.1f}ms{r['output_tok_s']:>11.1f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    log_dir = Path(f"/tmp/pagoda-routing-bench-{secrets.token_hex(3)}")
    log_dir.mkdir(parents=True)
    procs = Processes(log_dir)
    try:
        urls = start_stack(args, procs)
        results = asyncio.run(benchmark(args, urls))
    finally:
        procs.stop()
    print(table(args, results), flush=True)
    if args.out is not None:
        write_result(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})
    return results


if __name__ == "__main__":
    main()
