"""TTFT with a long shared system prompt: prefix cache cold vs warm.

    python -m benchmarks.prefix_ttft --base-url http://127.0.0.1:8000 \
        [--system-prompt-tokens 1024] [--num-requests 8] [--out prefix_ttft.json]

Every request is the same system prompt (token ids) followed by its own short suffix, generating
one token, sent one at a time so only the prefill is measured:
- cold: each request carries a unique `cache_salt`, so no cached block can match (full prefill);
- warm: every request carries one shared salt, after one warm-up request filled the cache.
- suffix only: the suffix alone (no system prompt): the floor a perfect cache could reach, i.e.
  the per-request cost (HTTP, gRPC, scheduling, one short prefill) that caching cannot remove.
The phases interleave, so machine noise hits them alike. The goal is warm >= 5x faster than cold.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from benchmarks.datasets import FIRST_ORDINARY_TOKEN
from benchmarks.result_file import write_result
from benchmarks.scrape import parse_metrics
from benchmarks.serve_client import Endpoint, RequestSpec, probe_vocab_size, send_request, served_model
from benchmarks.serve_metrics import RequestRecord

PREFIX_COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")
GOAL_SPEEDUP = 5.0


@dataclass(frozen=True, slots=True)
class PhaseStats:
    ttfts_s: list[float]
    cached_tokens: list[int]

    @property
    def median_s(self) -> float:
        return statistics.median(self.ttfts_s)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.ttfts_s)

    def to_json(self) -> dict:
        return {"ttfts_s": self.ttfts_s, "median_ttft_s": self.median_s, "mean_ttft_s": self.mean_s,
                "cached_tokens": self.cached_tokens}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_ttft", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--system-prompt-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=8, help="per phase (cold, warm)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the model card, else probed")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def make_prompts(vocab_size: int, system_len: int, suffix_len: int, count: int, seed: int):
    """(system prompt ids, one distinct suffix per request, an unrelated prompt for server warm-up)."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=n).tolist()

    return ids(system_len), [ids(suffix_len) for _ in range(count + 1)], ids(suffix_len)


async def scrape_prefix_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    try:
        reply = await client.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
        return parse_metrics(reply.text, PREFIX_COUNTERS) if reply.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


async def measure(args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout)) as client:
        card = await served_model(client, args.base_url)
        model = args.model or card["id"]
        vocab_size = args.vocab_size or card.get("vocab_size") or await probe_vocab_size(client, args.base_url, model)
        endpoint = Endpoint(args.base_url, model, "completions", args.request_timeout)
        system, suffixes, unrelated = make_prompts(vocab_size, args.system_prompt_tokens, args.suffix_tokens,
                                                   args.num_requests, args.seed)

        async def ttft(prompt: list[int], salt: str) -> RequestRecord:
            record = await send_request(client, endpoint, RequestSpec(prompt, 1, cache_salt=salt))
            if not record.success:
                raise SystemExit(f"request failed: {record.error}")
            return record

        await ttft(unrelated, secrets.token_hex(8))  # first-request costs (allocation, lazy init)
        warm_salt = secrets.token_hex(8)
        await ttft(system + suffixes[-1], warm_salt)  # fills the cache with the system prompt
        before = await scrape_prefix_counters(client, args.base_url)
        cold, warm, floor = [], [], []
        for suffix in suffixes[:-1]:  # interleaved: noise on a shared machine hits every phase alike
            cold.append(await ttft(system + suffix, secrets.token_hex(8)))
            warm.append(await ttft(system + suffix, warm_salt))
            floor.append(await ttft(suffix, secrets.token_hex(8)))
        after = await scrape_prefix_counters(client, args.base_url)
    cold_stats, warm_stats, floor_stats = (PhaseStats([r.ttft for r in rs], [r.cached_tokens for r in rs])
                                           for rs in (cold, warm, floor))
    return {"model": model, "system_prompt_tokens": args.system_prompt_tokens, "suffix_tokens": args.suffix_tokens,
            "num_requests": args.num_requests, "cold": cold_stats.to_json(), "warm": warm_stats.to_json(),
            "suffix_only": floor_stats.to_json(),
            "speedup_median": cold_stats.median_s / warm_stats.median_s,
            "prefix_cache_counters_delta": {k: after[k] - before[k] for k in after if k in before}}


def report(result: dict) -> str:
    cold, warm, floor = result["cold"], result["warm"], result["suffix_only"]
    lines = [f"System prompt: {result['system_prompt_tokens']} tokens, suffix {result['suffix_tokens']} tokens, "
             f"{result['num_requests']} requests per phase",
             f"cold TTFT: median {cold['median_ttft_s'] * 1000:.1f} ms, mean {cold['mean_ttft_s'] * 1000:.1f} ms, "
             f"cached tokens {cold['cached_tokens']}",
             f"warm TTFT: median {warm['median_ttft_s'] * 1000:.1f} ms, mean {warm['mean_ttft_s'] * 1000:.1f} ms, "
             f"cached tokens {warm['cached_tokens']}",
             f"suffix-only TTFT (the floor): median {floor['median_ttft_s'] * 1000:.1f} ms",
             f"speedup (median cold / median warm): {result['speedup_median']:.1f}x "
             f"(goal >= {GOAL_SPEEDUP:.0f}x: {'met' if result['speedup_median'] >= GOAL_SPEEDUP else 'NOT met'})"]
    if result["prefix_cache_counters_delta"]:
        lines.append(f"server prefix-cache counters during the phases: {result['prefix_cache_counters_delta']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(measure(args))
    print(report(result))
    if args.out is not None:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
