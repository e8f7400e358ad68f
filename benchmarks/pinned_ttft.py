"""TTFT of a long shared system prompt: cold, warm, pinned, and after an LRU flood.

    python -m benchmarks.pinned_ttft [--model models/smollm2-135m-instruct] [--system-tokens 1024]

Four one-token requests that start with the same system prompt (distinct user suffixes), offline:
- cold: the first user on an engine without pins (the whole prompt is prefilled);
- warm: the second user on that engine (the prefix is cached by the first);
- pinned: the first user on an engine started with `pinned_prompts=[system]`;
- after flood: both engines serve enough other prompts to cycle the whole KV pool through the
  LRU, then one more user: the unpinned engine has lost the prefix, the pinned one has not.
Prints a table (median of `--repeats`) and writes benchmarks/results/pinned_ttft.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.result_file import write_result
from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from pagoda.tools.default_model import DEFAULT_OUT

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN, use_tqdm=False)
    return time.perf_counter() - started, out.num_cached_tokens


def flood(llm: LLM, num_blocks: int, block_size: int, first_id: int) -> None:
    """Distinct prompts worth twice the pool: every unpinned cached block is evicted."""
    length = 256
    count = 2 * num_blocks * block_size // length + 1
    prompts = [{"prompt_token_ids": [first_id + (i * length + j) % 20000 for j in range(length)]}
               for i in range(count)]
    llm.generate(prompts, ONE_TOKEN, use_tqdm=False)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    system = [1000 + (37 * i) % 30000 for i in range(args.system_tokens)]
    results: dict[str, list[float]] = {"cold": [], "warm": [], "pinned": [], "unpinned_after_flood": [],
                                       "pinned_after_flood": []}
    cached: dict[str, int] = {}
    common = dict(dtype=args.dtype, num_gpu_blocks_override=args.num_blocks)
    for r in range(args.repeats):
        user = [[5 + r, 6 + u, 7] for u in range(4)]
        plain = LLM(args.model, **common)
        pinned = LLM(args.model, pinned_prompts=[system], **common)
        ttft(plain, [11, 12, 13])  # warm the kernels on something unrelated
        ttft(pinned, [11, 12, 13])
        for name, llm, suffix in (("cold", plain, user[0]), ("warm", plain, user[1]), ("pinned", pinned, user[0])):
            seconds, cached[name] = ttft(llm, system + suffix)
            results[name].append(seconds)
        for name, llm in (("unpinned_after_flood", plain), ("pinned_after_flood", pinned)):
            flood(llm, args.num_blocks, llm.worker_info.block_size, first_id=20000)
            seconds, cached[name] = ttft(llm, system + user[2])
            results[name].append(seconds)
        plain.close()
        pinned.close()
    summary = {name: {"ttft_ms_median": round(1000 * statistics.median(v), 1), "cached_tokens": cached[name]}
               for name, v in results.items()}
    print(f"\nTTFT with a {args.system_tokens}-token system prompt, {args.model}, {args.dtype}, "
          f"median of {args.repeats}")
    print(f"{'case':<24}{'TTFT ms':>10}{'cached tokens':>15}")
    for name, row in summary.items():
        print(f"{name:<24}{row['ttft_ms_median']:>10.1f}{row['cached_tokens']:>15}")
    write_result(args.out, {"model": args.model, "system_tokens": args.system_tokens, **summary})
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pinned_ttft", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_OUT))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=512, help="a pool small enough to flood quickly")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/pinned_ttft.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
