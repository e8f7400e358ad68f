"""Paged-attention decode benchmark for the CuPy backend against the memory roofline.

    python benchmarks/paged_attention.py           # sweep, table, benchmarks/results/paged_attention_<device>.json
    python benchmarks/paged_attention.py --check   # the GPU correctness tests (tests/gpu) only
    python benchmarks/paged_attention.py --smoke   # each kernel once (for compute-sanitizer)

Llama-3-8B-like layer: Hq=32, Hkv=8, D=128, block 16. Each rep: L2 flushed (a 256 MiB memset),
then CUDA events around one paged_attention call; median of --reps after warm-up. The ceiling is
the device-to-device copy bandwidth measured in the same run (read + write bytes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCHES = (1, 8, 64, 256)
CONTEXTS = (128, 512, 2048, 8192)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
L2_FLUSH_BYTES = 256 << 20


def time_ms(fn, reps: int, flush: torch.Tensor) -> float:
    """Median CUDA-event time of fn() with a cold L2 each rep."""
    fn()  # warm-up: compile caches, allocator
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(reps: int, flush: torch.Tensor) -> float:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps, flush)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def make_decode_batch(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, blocks_per_seq)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, tables, seq_lens, qsl


def min_bytes(batch: int, context: int, elem: int) -> int:
    """kernels.md §6: KV read once + q in + out + block-table entries."""
    kv = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * elem
    q_out = 2 * batch * NUM_HEADS * HEAD_DIM * elem
    return kv + q_out + batch * math.ceil(context / BLOCK_SIZE) * 4


def bench_row(backend, batch: int, context: int, dtype: torch.dtype, reps: int, flush, copy_gbs) -> dict:
    from kernels.splitk_mirror import choose_num_splits

    query, k_cache, v_cache, tables, seq_lens, qsl = make_decode_batch(batch, context, dtype)
    scale = HEAD_DIM**-0.5
    ms = time_ms(lambda: backend.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale,
                                                 1, context), reps, flush)
    gbs = min_bytes(batch, context, query.element_size()) / (ms * 1e-3) / 1e9
    splits = choose_num_splits(batch, NUM_KV_HEADS, context, torch.cuda.get_device_properties(0).multi_processor_count)
    return {"batch": batch, "context": context, "gqa": NUM_HEADS // NUM_KV_HEADS, "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE, "dtype": str(dtype).removeprefix("torch."), "num_splits": splits,
            "us": round(ms * 1e3, 2), "gbs": round(gbs, 1), "pct_of_copy": round(100 * gbs / copy_gbs, 1)}


def run_sweep(args) -> None:
    from kernels.paged_attention.cupy_impl import CupyBackend, KernelShape

    dtype = getattr(torch, args.dtype)
    backend = CupyBackend()
    backend.warmup([KernelShape(dtype, HEAD_DIM, BLOCK_SIZE, NUM_HEADS // NUM_KV_HEADS)])
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    copy_gbs = copy_bandwidth_gbs(args.reps, flush)
    name = torch.cuda.get_device_name(0)
    print(f"{name}: device-to-device copy {copy_gbs:.0f} GB/s (read + write)")
    print(f"{'B':>5} {'ctx':>6} {'splits':>6} {'us':>10} {'GB/s':>8} {'% copy':>7}")
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            row = bench_row(backend, batch, context, dtype, args.reps, flush, copy_gbs)
            rows.append(row)
            print(f"{batch:>5} {context:>6} {row['num_splits']:>6} {row['us']:>10.2f} {row['gbs']:>8.0f} "
                  f"{row['pct_of_copy']:>6.1f}%")
            torch.cuda.empty_cache()
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = ROOT / "benchmarks" / "results" / f"paged_attention_{slug}.json"
    write_result(out, {"device": name, "date": dt.date.today().isoformat(), "copy_gbs": round(copy_gbs, 1),
                       "reps": args.reps, "rows": rows})
    print(f"wrote {out.relative_to(ROOT)}")


def run_smoke() -> None:
    """One launch of each kernel (cache write, decode S=1, decode S>1 + reduce), for compute-sanitizer."""
    from kernels.paged_attention.cupy_impl import CupyBackend

    query, k_cache, v_cache, tables, seq_lens, qsl = make_decode_batch(3, 300, torch.bfloat16)
    seq_lens[1] = 1
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([5, -1, 40], device="cuda")
    CupyBackend().write_kv_cache(key, key.clone(), k_cache, v_cache, slots)
    for splits in (1, 4):
        out = CupyBackend(num_splits=splits).paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl,
                                                             0.088, 1, 300)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"NaN with {splits} splits"
    print("smoke: cache write, decode (1 split), decode (4 splits) + reduce ran")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="run the GPU correctness tests (tests/gpu) and exit")
    parser.add_argument("--smoke", action="store_true", help="launch each kernel once and exit")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("paged_attention benchmark: no CUDA device (torch.cuda.is_available() is False); "
              "run it on a GPU machine", file=sys.stderr)
        return 2
    if args.smoke:
        run_smoke()
        return 0
    if args.check:
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-x", "tests/gpu"], cwd=ROOT)
    run_sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
