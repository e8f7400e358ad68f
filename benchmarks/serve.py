"""Serving benchmark: an OpenAI-API load generator in the manner of `vllm bench serve`.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --dataset sharegpt-like \
        --num-prompts 64 --request-rate 4 [--burstiness 1] [--max-concurrency 16] \
        [--out results.json] [--plot DIR] [--sweep-request-rates 1,2,4 | --sweep-concurrency 1,4,16]

Arrivals follow a gamma process (burstiness 1 = Poisson); prompts are sent as token ids
(completions) so their lengths are exact, with `ignore_eos` and `max_tokens` so output lengths are
exact. While it runs, /metrics is sampled every 0.5 s (KV usage, queue depth, running, preemptions).
Each run sends its requests with a fresh `cache_salt`, so one run never hits the prefix cache that
an earlier run (or sweep point) filled; requests within a run share it (prefix-repetition).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import secrets
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
from tqdm import tqdm

from benchmarks.datasets import DATASETS, WorkloadSpec, make_workload
from benchmarks.result_file import write_result
from benchmarks.scrape import MetricsSampler
from benchmarks.serve_client import (
    Endpoint,
    RequestSpec,
    detokenize,
    probe_vocab_size,
    send_request,
    served_model,
)
from benchmarks.serve_metrics import RequestRecord, arrival_intervals, compute_metrics, format_table

CHAT_TEMPLATE_MARGIN = 64  # tokens the chat template may add around a prompt


@dataclass(frozen=True, slots=True)
class RunConfig:
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int
    cache_salt: str | None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dataset", choices=DATASETS, default="sharegpt-like")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--length-scale", type=float, default=1.0, help="shrink every length (CPU runs)")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.5)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the model card, else probed")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--metrics-url", default=None, help="default: BASE_URL/metrics")
    p.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics scrapes")
    p.add_argument("--no-cache-salt", action="store_true", help="let runs share the prefix cache")
    p.add_argument("--no-warmup", action="store_true", help="skip the single warm-up request")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write PNG plots into this directory")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--sweep-request-rates", type=_floats, default=None, help="e.g. 1,2,4")
    sweep.add_argument("--sweep-concurrency", type=_ints, default=None, help="e.g. 1,4,16")
    return p.parse_args(argv)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


async def build_requests(client: httpx.AsyncClient, args: argparse.Namespace, card: dict,
                         model: str) -> list[RequestSpec]:
    vocab_size = args.vocab_size or card.get("vocab_size") or await probe_vocab_size(client, args.base_url, model)
    max_model_len = int(card.get("max_model_len") or 2048)
    if args.endpoint == "chat":
        max_model_len -= CHAT_TEMPLATE_MARGIN
    spec = WorkloadSpec(dataset=args.dataset, num_prompts=args.num_prompts, vocab_size=vocab_size,
                        max_model_len=max_model_len, seed=args.seed, length_scale=args.length_scale,
                        input_len=args.random_input_len, output_len=args.random_output_len,
                        range_ratio=args.random_range_ratio, num_prefixes=args.num_prefixes,
                        prefix_len=args.prefix_len, suffix_len=args.suffix_len)
    items = make_workload(spec)
    texts: list[str | None] = [None] * len(items)
    if args.endpoint == "chat":  # chat takes text: decode the ids (lengths then change a little)
        texts = list(await asyncio.gather(*(detokenize(client, args.base_url, model, i.prompt_token_ids)
                                            for i in items)))
    return [RequestSpec(i.prompt_token_ids, i.max_tokens, text) for i, text in zip(items, texts, strict=True)]


async def run_once(client: httpx.AsyncClient, endpoint: Endpoint, requests: list[RequestSpec],
                   run: RunConfig, args: argparse.Namespace) -> dict:
    """Sends every request on the arrival schedule; returns the run's result (JSON-ready)."""
    requests = [replace(r, cache_salt=run.cache_salt) for r in requests]
    intervals = arrival_intervals(len(requests), run.request_rate, run.burstiness, run.seed)
    limit = asyncio.Semaphore(run.max_concurrency) if run.max_concurrency else contextlib.nullcontext()
    metrics_url = args.metrics_url or endpoint.base_url.rstrip("/") + "/metrics"
    sampler = MetricsSampler(client, metrics_url, args.metrics_interval)
    bar = tqdm(total=len(requests), disable=args.no_progress, desc="requests", leave=False)

    async def one(spec: RequestSpec) -> RequestRecord:
        async with limit:
            record = await send_request(client, endpoint, spec)
        bar.update(1)
        return record

    sampler.start()
    started = time.perf_counter()
    tasks: list[asyncio.Task] = []
    for index, spec in enumerate(requests):
        if index and intervals[index - 1] > 0:
            await asyncio.sleep(intervals[index - 1])  # the first request goes at t=0, as vLLM's
        tasks.append(asyncio.create_task(one(spec)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - started
    bar.close()
    server = await sampler.stop()
    metrics = compute_metrics(records, duration)
    title = f"rate={run.request_rate} burstiness={run.burstiness} concurrency={run.max_concurrency}"
    print(format_table(title, metrics, server.table_rows()), flush=True)
    errors = [r.error for r in records if not r.success]
    return {"request_rate": run.request_rate if run.request_rate != float("inf") else "inf",
            "burstiness": run.burstiness, "max_concurrency": run.max_concurrency,
            **metrics.to_json(), "server": asdict(server), "errors": errors[:5],
            "timeline": [asdict(s) for s in sampler.samples]}


async def warm_up(client: httpx.AsyncClient, endpoint: Endpoint, sample: RequestSpec) -> None:
    """One short request first (as vLLM's initial test run): fails fast on a bad setup."""
    record = await send_request(client, endpoint, replace(sample, max_tokens=2, cache_salt=secrets.token_hex(8)))
    if not record.success:
        raise SystemExit(f"warm-up request failed: {record.error}")


def sweep_points(args: argparse.Namespace) -> tuple[str | None, list[RunConfig]]:
    def config(rate: float, concurrency: int | None) -> RunConfig:
        salt = None if args.no_cache_salt else f"bench-{secrets.token_hex(6)}"
        return RunConfig(rate, args.burstiness, concurrency, args.seed, salt)

    if args.sweep_request_rates:
        return "request_rate", [config(r, args.max_concurrency) for r in args.sweep_request_rates]
    if args.sweep_concurrency:
        return "max_concurrency", [config(args.request_rate, c) for c in args.sweep_concurrency]
    return None, [config(args.request_rate, args.max_concurrency)]


async def benchmark(args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        card = await served_model(client, args.base_url)
        model = args.model or card["id"]
        endpoint = Endpoint(args.base_url, model, args.endpoint, args.request_timeout)
        requests = await build_requests(client, args, card, model)
        if not args.no_warmup:
            await warm_up(client, endpoint, requests[0])
        parameter, points = sweep_points(args)
        runs = [await run_once(client, endpoint, requests, point, args) for point in points]
    header = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_description(),
              "base_url": args.base_url, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
              "num_prompts": args.num_prompts, "length_scale": args.length_scale, "seed": args.seed}
    if parameter is None:
        return {**header, **runs[0]}
    return {**header, "sweep": parameter, "runs": runs}


def machine_description() -> str:
    return f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, {platform.system()}".strip()


# The flags that decide which kernels a CPU engine may use (torch/oneDNN, ggml): vector width,
# VNNI/AMX for int8, bf16/fp16 conversions.
SIMD_FLAG_PREFIXES = ("sse4", "ssse3", "avx", "amx", "fma", "f16c", "vnni", "bmi2")


def cpu_features(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and its SIMD flags, from /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"model": platform.processor() or None, "flags": []}
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first CPU's; the others are the same
    flags = sorted(f for f in fields.get("flags", "").split() if f.startswith(SIMD_FLAG_PREFIXES))
    return {"model": fields.get("model name") or platform.processor() or None, "flags": flags}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(benchmark(args))
    if args.out is not None:
        write_result(args.out, result)
        print(f"results written to {args.out}")
    if args.plot is not None:
        from benchmarks.plots import plot_results

        for path in plot_results(result, args.plot):
            print(f"plot written to {path}")
    return result


if __name__ == "__main__":
    main()
