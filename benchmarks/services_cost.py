"""What the service split costs: the same requests through the in-process engine and through the
gateway -> scheduler -> worker processes, at the same concurrency.

    .venv/bin/python -m benchmarks.services_cost [--model models/smollm2-135m-instruct]
        [--num-prompts 48] [--concurrency 16] [--input-len 256] [--output-len 128] [--dtype float32]

In-process: `pagoda.LLM` with max_num_seqs = concurrency (never more than that many running, as a
client holding that many in flight). Served: `pagoda.entrypoints.launcher`, the requests sent as token ids with
at most `concurrency` in flight (benchmarks/serve_client.py: streamed, greedy, EOS ignored).
Both generate exactly the same tokens; prints output tok/s each and served / in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import sys
import time
from pathlib import Path

import httpx

from benchmarks import vllm_peer as peer
from benchmarks.datasets import WorkloadSpec, make_workload
from benchmarks.result_file import write_result
from benchmarks.serve_client import Endpoint, RequestSpec, send_request, served_model
from benchmarks.serve_metrics import compute_metrics
from benchmarks.vs_vllm_offline import produced, timed_generate, warm_up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.services_cost", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--log-dir", type=Path, default=Path("benchmarks/results/services_cost_logs"))
    return p.parse_args(argv)


def in_process(args: argparse.Namespace, items) -> dict:
    from pagoda import LLM, SamplingParams

    workload = [{"prompt_token_ids": item.prompt_token_ids, "max_tokens": item.max_tokens} for item in items]
    with LLM(model=args.model, dtype=args.dtype, device="cpu", max_num_seqs=args.concurrency) as llm:
        generate = functools.partial(llm.generate, use_tqdm=False)
        warm_up(generate, SamplingParams)
        seconds, outputs = timed_generate(generate, SamplingParams, workload)
    tokens = produced(outputs)
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}


async def _serve_all(base_url: str, items, concurrency: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        model = (await served_model(client, base_url))["id"]
        endpoint = Endpoint(base_url, model)
        specs = [RequestSpec(item.prompt_token_ids, item.max_tokens) for item in items]
        await send_request(client, endpoint, RequestSpec(specs[0].prompt_token_ids, 2))  # warm-up
        limit = asyncio.Semaphore(concurrency)

        async def one(spec: RequestSpec):
            async with limit:
                return await send_request(client, endpoint, spec)

        started = time.perf_counter()
        records = await asyncio.gather(*(one(spec) for spec in specs))
        seconds = time.perf_counter() - started
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    metrics = compute_metrics(records, seconds).to_json()
    tokens = sum(r.output_len for r in records)
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "tpot_median_ms": metrics["median_tpot_s"] * 1e3, "ttft_median_ms": metrics["median_ttft_s"] * 1e3}


def served(args: argparse.Namespace, items) -> dict:
    ports = {name: peer.free_port() for name in ("http", "grpc", "scheduler", "worker")}
    argv = [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", args.model, "--device", "cpu",
            "--dtype", args.dtype, "--gateway-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
            "--scheduler-port", str(ports["scheduler"]), "--worker-port", str(ports["worker"])]
    base_url = f"http://127.0.0.1:{ports['http']}"
    proc = peer.start_server(argv, None, args.log_dir / "launcher.log")
    try:
        peer.wait_ready(proc, base_url, timeout_s=300)
        return asyncio.run(_serve_all(base_url, items, args.concurrency))
    finally:
        peer.stop_server(proc)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    card = json.loads((Path(args.model) / "config.json").read_text())
    items = make_workload(WorkloadSpec(dataset="random", num_prompts=args.num_prompts, vocab_size=card["vocab_size"],
                                       input_len=args.input_len, output_len=args.output_len,
                                       range_ratio=args.range_ratio, max_model_len=4096))
    print(f"{len(items)} requests, random {args.input_len}±{args.range_ratio:.0%} in / "
          f"{args.output_len}±{args.range_ratio:.0%} out, {args.concurrency} in flight, {args.dtype}", flush=True)
    result = {"in_process": in_process(args, items)}
    gc.collect()
    result["served"] = served(args, items)
    result["served_over_in_process"] = (result["served"]["output_tokens_per_s"]
                                        / result["in_process"]["output_tokens_per_s"])
    print(f"in-process engine: {result['in_process']['output_tokens_per_s']:.1f} output tok/s\n"
          f"through the services: {result['served']['output_tokens_per_s']:.1f} output tok/s "
          f"(TPOT p50 {result['served']['tpot_median_ms']:.1f} ms, TTFT p50 {result['served']['ttft_median_ms']:.1f} ms)\n"
          f"served / in-process: {result['served_over_in_process']:.1%}")
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
