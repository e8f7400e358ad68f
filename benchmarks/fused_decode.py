"""One decode step's forward, the module loop against the fused op (kernels/decode/), in-process.

    python -m benchmarks.fused_decode [--model models/smollm2-135m-instruct] [--quantization gguf|int8|int4]
        [--dtype float32|bfloat16] [--threads 1] [--batch 1] [--context 256] [--iters 40]
        [--int8-dot] [--clock wall|thread] [--prefill N]

--int8-dot compares, instead, the fused step with the quantized linears' integer dot-product path
for 8-bit codes (kernels/linear/cpu_quant_int8dot.cpp) at int16 activations (the default), int8
ones and off (fp32 activations), in three parts timed separately: the forward (embedding + layers
+ final norm), the logits (the lm_head) and a greedy sampler call.
A Q8_0 file's scales are kept fp16 at load (worker_svc/models/quant_linear.py keep_half_scales):
the int16 and int8 columns read them as they are, the off column widens an fp32 copy per call.
--clock thread times with the calling thread's CPU time (with --threads 1: the whole op), which
a shared machine's other jobs disturb less than the wall clock (they still share caches and DRAM).

The model is loaded and prepared as the CPU worker prepares it (packed and row-bucketed linears,
or quantized ones), every sequence has `--context` cached tokens (random K/V) and one new token;
the two paths run alternately, so a busy machine disturbs both alike. `--prefill N` times, instead,
one prompt of N tokens over an empty cache (the fused op runs every step since issue 32, prefills
included: what that costs against the module loop's multi-threaded element-wise ops). Prints min and median ms
of `model(...)` (embedding + layers + final norm; logits excluded) and the ratio of the minima.
`--threads 1` is the steadier figure on a shared machine: two OpenMP threads spin against other
jobs' processes, and every one of the ~120 parallel regions of a step waits for the slower one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import get_backend
from worker_svc.model_loader.loader import load_model
from worker_svc.models.common import AttentionMetadata
from worker_svc.models.fused_decode import Setting, fused_decode_for
from worker_svc.models.packed_linear import PackedLinear, can_pack, pack_linear_weights
from worker_svc.models.row_buckets import bucket_linear_rows

BLOCK = 16


def decode_metadata(batch: int, context: int) -> AttentionMetadata:
    per_seq = context // BLOCK + 1
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    slots = tables[:, context // BLOCK].long() * BLOCK + context % BLOCK
    return AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
                             query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                             max_query_len=1, max_seq_len=context + 1, backend=get_backend("cpu"))


def prefill_metadata(rows: int) -> AttentionMetadata:
    """One sequence whose `rows` tokens are all new (a whole prompt over an empty cache)."""
    tables = torch.arange(rows // BLOCK + 1, dtype=torch.int32).view(1, -1)
    return AttentionMetadata(slot_mapping=torch.arange(rows, dtype=torch.int64), block_tables=tables,
                             seq_lens=torch.tensor([rows], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
                             max_query_len=rows, max_seq_len=rows, backend=get_backend("cpu"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--quantization", default=None, help="gguf (a .gguf as stored), int8, int4")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--int8-dot", action="store_true", help="integer dot-product path: int16 / int8 / off (fused step)")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"])
    p.add_argument("--prefill", type=int, default=0, help="time a prompt of N tokens instead of a decode step")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, cpu = getattr(torch, args.dtype), torch.device("cpu")
    quantization = args.quantization or ("gguf" if args.model.endswith(".gguf") else None)
    model, cfg = load_model(args.model, dtype, cpu, quantization=quantization)
    if quantization is None and can_pack(cpu, dtype):
        pack_linear_weights(model)
        bucket_linear_rows(model, PackedLinear)
    fused, why = fused_decode_for(model, Setting(cpu, dtype, dtype, "cpu"))
    if fused is None:
        raise SystemExit(f"the fused path does not run this model: {why}")
    attn = prefill_metadata(args.prefill) if args.prefill else decode_metadata(args.batch, args.context)
    num_blocks = args.prefill // BLOCK + 1 if args.prefill else args.batch * (args.context // BLOCK + 1)
    shape = (num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(shape, generator=gen).to(dtype) * 0.1, torch.randn(shape, generator=gen).to(dtype) * 0.1)
              for _ in range(cfg.num_layers)]
    rows = args.prefill or args.batch
    ids = torch.randint(2, cfg.vocab_size, (rows,), generator=gen)
    positions = torch.arange(rows) if args.prefill else torch.full((rows,), args.context)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.int8_dot:
        int8_dot_parts(model, fused, ids, positions, attn, caches, args, clock)
        return
    times: dict[str, list[float]] = {"module loop": [], "fused": []}
    with torch.inference_mode():
        for i in range(args.iters + 3):
            for name, path in (("module loop", None), ("fused", fused)):
                model.fused_decode = path
                start = clock()
                model(ids, positions, attn, caches)
                if i >= 3:  # warm-up: oneDNN primitives, first-touch pages
                    times[name].append((clock() - start) * 1e3)
    print(f"{args.model} quantization={quantization} dtype={args.dtype} threads={torch.get_num_threads()} "
          + (f"prefill={args.prefill}" if args.prefill else f"batch={args.batch} context={args.context}"))
    for name, values in times.items():
        print(f"  {name:12s} min {min(values):7.2f} ms   median {statistics.median(values):7.2f} ms")
    print(f"  fused / module loop (min): {min(times['fused']) / min(times['module loop']):.2f}")


ACTS = {16: "int16", 8: "int8", 32: "off"}  # the op's activation precisions, the default first


def int8_dot_parts(model, fused, ids, positions, attn, caches, args, clock) -> None:
    """Forward, logits and a greedy sampler call, with the integer dot path at int16 and int8
    activations and off (fp32 activations), alternately."""
    from pagoda.contract.params import SamplingParams
    from worker_svc.sampler import Sampler, SamplingRow

    ops = fused.ops
    mode, best, default = ops.quant_int8_dot()
    sampler = Sampler(eos_token_ids=[0], device=torch.device("cpu"))
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1, 2, 3], 3) for _ in range(args.batch)]
    model.fused_decode = fused
    parts = ("forward", "logits", "sampler")
    times = {(act, part): [] for act in ACTS for part in parts}
    with torch.inference_mode():
        for i in range(args.iters + 3):
            for act in ACTS:
                ops.quant_int8_dot(1, act)  # act 32: on, but every call takes the fp32 path
                t0 = clock()
                hidden = model(ids, positions, attn, caches)
                t1 = clock()
                logits = model.compute_logits(hidden)
                t2 = clock()
                sampler(logits, rows)
                t3 = clock()
                if i >= 3:
                    for part, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                        times[(act, part)].append(value * 1e3)
    ops.quant_int8_dot(int(mode != 0), default)
    print(f"{args.model} dtype={args.dtype} threads={torch.get_num_threads()} batch={args.batch} "
          f"context={args.context} clock={args.clock} kernel={['none', 'avx512_vnni', 'avx_vnni'][best]}")
    for part in parts:
        off = statistics.median(times[(32, part)])
        print(f"  {part:8s} " + "   ".join(
            f"{ACTS[act]}: min {min(times[(act, part)]):7.3f} median {statistics.median(times[(act, part)]):7.3f} ms"
            for act in ACTS) + "   (median / off: " + " ".join(
            f"{ACTS[act]} {statistics.median(times[(act, part)]) / off:.2f}" for act in (16, 8)) + ")")


if __name__ == "__main__":
    main()
