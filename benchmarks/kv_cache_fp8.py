"""FP8 KV cache: what it buys (blocks per byte) and what it costs (greedy agreement, speed).

    python -m benchmarks.kv_cache_fp8 [--model models/smollm2-135m-instruct] [--max-tokens 64]

- Blocks: the worker's capacity planner for a fixed CPU budget (`--budget-mib`), per cache dtype.
- Agreement: greedy chat completions of `--num-prompts` questions with the model's own cache dtype
  (fp32 for the default model) and with each FP8 format; for every prompt, the position of the
  first token that differs (max_tokens when none). Prints the distribution.
- Speed: the same batch's output tokens/s per cache dtype (one run each: indicative only).
Writes benchmarks/results/kv_cache_fp8.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.result_file import write_result
from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from pagoda.tools.default_model import DEFAULT_OUT

TOPICS = ["the water cycle", "how a hash table works", "the French revolution", "photosynthesis",
          "what a compiler does", "the rules of chess", "how vaccines work", "black holes",
          "the stock market", "how to bake bread", "the history of the internet", "plate tectonics",
          "how a bicycle stays upright", "the theory of evolution", "what DNS is", "how batteries work",
          "the causes of the first world war", "machine learning", "the moon landing", "inflation",
          "how airplanes fly", "the human heart", "recursion in programming", "climate change",
          "the Roman empire", "how a refrigerator works", "prime numbers", "the printing press",
          "how the eye sees colour", "supply and demand", "volcanoes", "the speed of light"]


def chat_prompts(tokenizer, n: int) -> list[dict]:
    prompts = []
    for topic in (TOPICS * (n // len(TOPICS) + 1))[:n]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"Explain {topic} in a few sentences."}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append({"prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)})
    return prompts


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict = {"model": args.model, "budget_mib": args.budget_mib, "max_tokens": args.max_tokens}
    outputs: dict[str, list[list[int]]] = {}
    for cache in ("auto", "fp8_e4m3", "fp8_e5m2"):
        llm = LLM(args.model, kv_cache_dtype=cache, kv_cache_memory_bytes=args.budget_mib << 20)
        prompts = chat_prompts(llm.tokenizer, args.num_prompts)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm
        started = time.perf_counter()
        done = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        outputs[cache] = [r.outputs[0].token_ids for r in done]
        results[cache] = {"num_blocks": llm.worker_info.num_blocks,
                          "cache_dtype": str(llm.runner.kv_cache.storage.dtype).removeprefix("torch."),
                          "output_tok_s": round(len(prompts) * args.max_tokens / seconds, 1)}
        llm.close()
    for cache in ("fp8_e4m3", "fp8_e5m2"):
        positions = [first_divergence(a, b) for a, b in zip(outputs["auto"], outputs[cache], strict=True)]
        results[cache]["blocks_vs_auto"] = round(results[cache]["num_blocks"] / results["auto"]["num_blocks"], 2)
        results[cache]["identical"] = sum(p == args.max_tokens for p in positions)
        results[cache]["first_divergence"] = sorted(positions)
        results[cache]["first_divergence_median"] = statistics.median(positions)
    print(f"\nFP8 KV cache, {args.model}, {args.num_prompts} chat prompts x {args.max_tokens} greedy tokens, "
          f"{args.budget_mib} MiB of cache")
    print(f"{'cache':<10}{'dtype':<16}{'blocks':>8}{'x auto':>8}{'tok/s':>8}{'identical':>11}  first divergence")
    for cache in ("auto", "fp8_e4m3", "fp8_e5m2"):
        row = results[cache]
        extra = "" if cache == "auto" else (f"{row['identical']:>8}/{args.num_prompts}  median "
                                             f"{row['first_divergence_median']}, all {row['first_divergence']}")
        ratio = 1.0 if cache == "auto" else row["blocks_vs_auto"]
        print(f"{cache:<10}{row['cache_dtype']:<16}{row['num_blocks']:>8}{ratio:>7.2f}x{row['output_tok_s']:>8.1f}"
              f"{extra:>11}")
    write_result(args.out, results)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache_fp8", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_OUT))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget-mib", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results/kv_cache_fp8.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
