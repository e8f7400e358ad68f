"""CPU paged attention: the torch reference backend against the compiled `cpu` backend, per call.

    python -m benchmarks.cpu_paged_attention                  # fp32 and bf16, torch's thread count
    python -m benchmarks.cpu_paged_attention --threads 1 --dtypes float32

SmolLM2-135M's attention shapes (Hq=9, Hkv=3, D=64, block 16). Every call of a case uses the same
metadata, as the 30 layers of one step do, so the reference's per-step plan is built once and
reused (its steady state in the worker); the kernel needs none. Median of --reps after warm-up.
The caches are shuffled over a pool twice the need, so block tables are not contiguous.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from kernels import get_backend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16

# (label, [(seq_len, q_len), ...])
CASES = [
    ("decode B=16 ctx=256", [(256, 1)] * 16),
    ("decode B=16 ctx=1024", [(1024, 1)] * 16),
    ("decode B=64 ctx=256", [(256, 1)] * 64),
    ("decode B=64 ctx=1024", [(1024, 1)] * 64),
    ("decode B=64 ctx 64..1024 mixed", [(64 + 15 * i, 1) for i in range(64)]),
    ("prefill 512 (no prefix)", [(512, 512)]),
    ("prefill chunk 256 over 768 cached", [(1024, 256)]),
    ("mixed: 32 decode + chunk 256/512", [(300 + 20 * i, 1) for i in range(32)] + [(512, 256)]),
]


def make_inputs(seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(s / BLOCK_SIZE) for s, _ in seqs]
    pool = 2 * sum(needed)
    shape = (pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(pool, generator=gen)
    tables = torch.zeros(len(seqs), max(needed), dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used:used + n].int()
        used += n
    q_lens = [q for _, q in seqs]
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (query, k_cache, v_cache, tables, seq_lens, qsl, HEAD_DIM**-0.5, max(q_lens), int(seq_lens.max()))


def time_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()  # warm-up: plans, allocator, page faults
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = {"torch": get_backend("torch"), "cpu": get_backend("cpu")}
    print(f"Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}, "
          f"{torch.get_num_threads()} threads, median of {args.reps}")
    print(f"{'case':<36} {'dtype':<9} {'torch us':>10} {'cpu us':>10} {'speed-up':>9} {'KV GB/s':>8}")
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for label, seqs in CASES:
                inputs = make_inputs(seqs, dtype)
                us = {name: time_us(lambda b=b, x=inputs: b.paged_attention(*x), args.reps)
                      for name, b in backends.items()}
                kv_bytes = sum(s for s, _ in seqs) * 2 * NUM_KV_HEADS * HEAD_DIM * inputs[1].element_size()
                print(f"{label:<36} {dtype_name:<9} {us['torch']:>10.0f} {us['cpu']:>10.0f} "
                      f"{us['torch'] / us['cpu']:>8.1f}x {kv_bytes / us['cpu'] / 1e3:>8.1f}")


if __name__ == "__main__":
    main()
