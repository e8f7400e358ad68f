"""Swap vs recompute preemption, offline: the same batch in a pool too small for it.

    python -m benchmarks.swap_preemption [--model models/smollm2-135m-instruct] [--prompts 6]
        [--prompt-tokens 256] [--max-tokens 64] [--num-blocks 50] [--swap-space 0.0625]
        [--long-prefill-token-threshold 256]

Runs the batch (random prompt token ids, greedy, ignore_eos) four ways: with room for all (no
preemption), then in `--num-blocks` blocks with `preemption_mode` recompute, swap, and auto (None).
Prints wall time, preemptions, swapped blocks and the prefill tokens computed (recomputation
included), checks that every run produced the roomy run's tokens, and writes
benchmarks/results/swap_preemption.json.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from benchmarks.result_file import write_result
from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from pagoda.tools.default_model import DEFAULT_OUT

RESULTS = Path(__file__).parent / "results" / "swap_preemption.json"


def run(args: argparse.Namespace, prompts: list[dict], params: SamplingParams, **engine) -> dict:
    with LLM(model=args.model, dtype=args.dtype, block_size=16, seed=0,
             long_prefill_token_threshold=args.long_prefill_token_threshold, **engine) as llm:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        stats = llm.stats()
    return {"seconds": round(seconds, 2), "preemptions": stats.num_preemptions,
            "swap_preemptions": stats.num_swap_preemptions, "blocks_swapped_out": stats.blocks_swapped_out,
            "blocks_swapped_in": stats.blocks_swapped_in, "prefill_tokens": stats.prefill_tokens_computed,
            "tokens": [o.outputs[0].token_ids for o in outputs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_OUT))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    # 3 prompts fit (48 blocks) and start decoding; growing to 20 blocks each, they preempt.
    p.add_argument("--num-blocks", type=int, default=50, help="the tight pool (blocks of 16)")
    p.add_argument("--swap-space", type=float, default=0.0625, help="GiB of host memory for swap")
    p.add_argument("--long-prefill-token-threshold", type=int, default=256,
                   help="one prefill chunk: auto mode swaps sequences longer than this")
    args = p.parse_args()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(args.prompt_tokens)]}
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    tight = {"num_gpu_blocks_override": args.num_blocks}
    runs = {"roomy": run(args, prompts, params)}
    runs["recompute"] = run(args, prompts, params, preemption_mode="recompute", **tight)
    runs["swap"] = run(args, prompts, params, preemption_mode="swap", swap_space=args.swap_space, **tight)
    runs["auto"] = run(args, prompts, params, swap_space=args.swap_space, **tight)
    want = runs["roomy"]["tokens"]
    print(f"{'run':<10} {'seconds':>8} {'preemptions':>12} {'swapped':>8} {'blocks out/in':>14} "
          f"{'prefill tokens':>15} same tokens")
    for name, r in runs.items():
        print(f"{name:<10} {r['seconds']:>8} {r['preemptions']:>12} {r['swap_preemptions']:>8} "
              f"{r['blocks_swapped_out']:>6}/{r['blocks_swapped_in']:<7} {r['prefill_tokens']:>15} "
              f"{r.pop('tokens') == want}")
    write_result(RESULTS, {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
