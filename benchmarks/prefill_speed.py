"""Prompt processing speed (llama-bench's pp512): one prompt of N tokens over an empty cache, in-process.

    python -m benchmarks.prefill_speed --model models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
        [--prompt 512] [--iters 3] [--threads N] [--compare] [--clock wall|thread]

The model is loaded and prepared as the CPU worker prepares it (load_model: a GGUF's linears as
stored, Q8_0 scales fp16, 8-bit rows interleaved; the fused op for every layer), and one forward
of `--prompt` tokens (embedding, every layer, final norm, the last token's logits) is timed
`--iters` times after one warm-up. Prints prompt tokens/s from the fastest and the median run.

--compare also times, alternately in the same process, the quantized linears' prefill rows with
fp32 activations (the op's `act` default set to 32): the path every prompt took before the int16
GEMM (kernels/linear/cpu_quant_gemm16.cpp) -- weight rows widened to fp32 blocks, then at::mm.
That default also moves decode rows to fp32, which a prompt of more than 32 tokens never takes.
--clock thread (with --threads 1) times the calling thread's CPU time: steadier on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.fused_decode import BLOCK, prefill_metadata
from worker_svc.model_loader.loader import load_model
from worker_svc.models.fused_decode import Setting, fused_decode_for
from worker_svc.models.quant_linear import _ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file (or an HF directory)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compare", action="store_true", help="also time the fp32-activation prefill (the old path)")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    start = time.perf_counter()
    model, cfg = load_model(args.model, torch.float32, cpu,
                            quantization="gguf" if args.model.endswith(".gguf") else None)
    load_s = time.perf_counter() - start
    fused, why = fused_decode_for(model, Setting(cpu, torch.float32, torch.float32, "cpu"))
    model.fused_decode = fused
    rows = args.prompt
    attn = prefill_metadata(rows)
    shape = (rows // BLOCK + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (rows,), generator=gen)
    positions = torch.arange(rows)
    ops = _ops()
    mode, _, default = ops.quant_int8_dot() if ops is not None and hasattr(ops, "quant_int8_dot") else (0, 0, 32)
    paths = {"default": default} | ({"fp32 activations": 32} if args.compare and mode else {})
    times: dict[str, list[float]] = {name: [] for name in paths}
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    with torch.inference_mode():
        for i in range(args.iters + 1):
            for name, act in paths.items():
                if mode:
                    ops.quant_int8_dot(int(mode != 0), act)
                t0 = clock()
                hidden = model(ids, positions, attn, caches)
                model.compute_logits(hidden[-1:])
                if i:  # the first pass warms oneDNN primitives and first-touch pages
                    times[name].append(clock() - t0)
    if mode:
        ops.quant_int8_dot(int(mode != 0), default)
    print(f"{args.model}: load {load_s:.1f} s, fused op {why}, threads {torch.get_num_threads()}, "
          f"pp{rows}, int16 default {default == 16}, clock {args.clock}")
    for name, values in times.items():
        print(f"  {name:17s} {rows / min(values):8.1f} prompt tok/s (best)  {rows / statistics.median(values):8.1f} (median)"
              f"  [{min(values):.2f} s]")
    if len(times) == 2:
        a, b = (min(v) for v in times.values())
        print(f"  speed-up (best): {b / a:.2f}x")


if __name__ == "__main__":
    main()
