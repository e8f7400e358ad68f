"""A session's next turn after a worker restart: its history loaded from the disk tier, or recomputed.

    python -m benchmarks.disk_restart [--model models/smollm2-135m-instruct] [--history 1000]
        [--others 3] [--reps 2] [--out benchmarks/results/disk_restart.json]

Offline, through `LLM` (fp32, CPU): a session's first turn (`--history` tokens, 32 generated), then
`--others` sessions of the same length through a device pool that holds about one session and a
host tier of 16 blocks, so the session's blocks go device -> host -> disk (`--kv-offload-dir`, a
temporary directory). The LLM is closed (the worker's device and host memory are gone), and the
session's next turn (history + reply + 100 new tokens, 1 output token: the time is its TTFT) runs
in a new LLM on the same directory, against a new LLM without tiers (recompute). Each rep starts
new LLMs; the times exclude model loading and a first 8-token warm-up request. Prints both times, the cached tokens and the blocks
loaded from disk, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time

from benchmarks.result_file import write_result
from pagoda import LLM, SamplingParams
from worker_svc.model_loader.model_config import ModelConfig

HOST_BLOCKS = 16


def make_llm(model: str, num_blocks: int, disk_dir: str | None, block_bytes: int) -> LLM:
    tiers = dict(kv_offloading_size=HOST_BLOCKS * block_bytes / (1 << 30), kv_offload_dir=disk_dir,
                 kv_offload_dir_size=1.0) if disk_dir else {}
    return LLM(model=model, dtype="float32", device="cpu", seed=0, num_gpu_blocks_override=num_blocks, **tiers)


def warm_up(llm: LLM) -> None:
    """A first forward pays one-time costs (kernel loading, weight packing): not the turn's."""
    timed_turn(llm, [11, 12, 13, 14, 15, 16, 17, 18], 2)


def timed_turn(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - started, list(out.outputs[0].token_ids), out.num_cached_tokens


def one_rep(args: argparse.Namespace, rng: random.Random) -> dict:
    session = [rng.randrange(10, 40000) for _ in range(args.history)]
    num_blocks = args.history // 16 + 24  # about one session at its next turn's length
    with tempfile.TemporaryDirectory() as disk_dir:
        config = ModelConfig.from_dir(args.model)  # a block's K and V over every layer, fp32
        block_bytes = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 4
        llm = make_llm(args.model, num_blocks, disk_dir, block_bytes)
        _, reply, _ = timed_turn(llm, session, 32)
        for _ in range(args.others):
            timed_turn(llm, [rng.randrange(10, 40000) for _ in range(args.history)], 32)
        written = llm.stats().blocks_disk_written
        llm.close()
        del llm
        next_turn = session + reply + [rng.randrange(10, 40000) for _ in range(100)]
        restarted = make_llm(args.model, num_blocks, disk_dir, block_bytes)
        warm_up(restarted)  # 8 tokens: half a block from the free list, nothing evicted
        disk_s, disk_token, cached = timed_turn(restarted, next_turn, 1)
        loaded = restarted.stats().blocks_disk_loaded
        restarted.close()
        del restarted
    fresh = make_llm(args.model, num_blocks, None, 0)
    warm_up(fresh)
    recompute_s, recompute_token, _ = timed_turn(fresh, next_turn, 1)
    del fresh
    assert disk_token == recompute_token, "greedy output differs between the disk hit and the recompute"
    return dict(disk_s=disk_s, recompute_s=recompute_s, cached_tokens=cached, prompt_tokens=len(next_turn),
                blocks_written=written, blocks_loaded=loaded)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--history", type=int, default=1000)
    p.add_argument("--others", type=int, default=3)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/disk_restart.json")
    args = p.parse_args()
    rng = random.Random(0)
    reps = [one_rep(args, rng) for _ in range(args.reps)]
    disk = statistics.median(r["disk_s"] for r in reps)
    recompute = statistics.median(r["recompute_s"] for r in reps)
    print(f"next turn after a restart ({reps[0]['prompt_tokens']} prompt tokens, median of {args.reps}): "
          f"disk tier {disk:.3f} s ({reps[0]['cached_tokens']} cached tokens, {reps[0]['blocks_loaded']} "
          f"blocks loaded), recompute {recompute:.3f} s: {recompute / disk:.2f}x")
    write_result(args.out, {"args": vars(args), "cpu": platform.processor() or platform.machine(),
                            "reps": reps, "disk_s_median": disk, "recompute_s_median": recompute})


if __name__ == "__main__":
    main()
