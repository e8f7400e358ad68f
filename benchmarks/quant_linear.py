"""Weight-only quantized linears on CPU (worker_svc/models/quant_linear.py) against our oneDNN-packed
fp32 linear and what torch ships, on SmolLM2's shapes; and (--model-step) the model's decode step.

    .venv/bin/python -m benchmarks.quant_linear [--rows 1 4 16 128] [--threads N] [--lm-head]
    .venv/bin/python -m benchmarks.quant_linear --model-step [--model models/smollm2-135m-instruct]
        [--gguf models/.cache/SmolLM2-135M-Instruct.Q4_1.gguf] [--batches 1 16]
    .venv/bin/python -m benchmarks.quant_linear --requantize F32.gguf OUT.gguf Q8_0   # a Q8_0 file
    .venv/bin/python -m benchmarks.quant_linear --cold [--rows 1 4 16] [--threads 2]
        # Q8_0-format weights (fp16 scales) row-major against rows interleaved by 16, each call on
        # weights not read since many calls (copies cycled): what a decode step's weights see

Layer table, ms per call (lower is better); columns:
  packed fp32   mkldnn._linear_pointwise over the weight packed once (what the worker runs today)
  aten int8/ch  aten._weight_int8pack_mm: int8 weight, one scale per output row (cannot hold Q8_0's
                per-32 scales), fp32 activations
  aten int4/g32 aten._weight_int4pack_mm_for_cpu: w = (q - 8) * scale + zero per group of 32, bf16
                activations and scales (its fp32 path asks for the same packed layout)
  ours i16/g32  pagoda_cpu::quant_linear, Q8_0's format (int8, fp32 scale per 32): at M <= 32 on a
                VNNI CPU (the default), int16 dot products over activations quantized to int16 per 32
  ours i8/g32   the same with activations quantized to int8 per 32 (act 8, PAGODA_INT8_DOT=8)
  ours fp32act  the same with fp32 activations (act 32, PAGODA_INT8_DOT=0): codes widened to fp32 in registers
  ours int4/g32 pagoda_cpu::quant_linear, Q4_1's format (packed nibbles, scale + min per 32)

Figures from a 2-core AMD EPYC shared with other jobs (noisy; re-measure on a quiet machine),
torch 2.13, AVX2 build of our op, 2 threads (docs/quantization.md has the table and the step times).
"""

from __future__ import annotations

import argparse
import time

import torch

from worker_svc.model_loader.quant_format import quantize
from worker_svc.models.quant_linear import quant_matmul

SHAPES = [(1536, 576), (576, 1536), (49152, 576)]  # (out, in): up, down, lm_head


def time_it(fn, min_seconds: float = 0.3) -> float:
    fn()
    count, started = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds and count >= 3:
            return elapsed / count


def _aten_int4(w: torch.Tensor):
    """aten's int4: asymmetric per-32 groups packed by _convert_weight_to_int4pack_for_cpu."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale  # w = (q - 8) * scale + zero
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)  # [K/32, N, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)


def layer_table(rows: list[int], shapes: list[tuple[int, int]]) -> None:
    from worker_svc.models.quant_linear import _ops, int8_dot_status

    ops = _ops()
    if ops is not None and hasattr(ops, "quant_int8_dot"):
        ops.quant_int8_dot(1)  # on (a server's default unless PAGODA_INT8_DOT=0); each call picks its act
    print(f"int8 dot kernel: {' '.join(int8_dot_status())}")
    print(f"{'shape':>12} {'M':>4} {'packed fp32':>12} {'aten int8/ch':>13} {'aten int4/g32':>14} "
          f"{'ours i16/g32':>13} {'ours i8/g32':>12} {'ours fp32act':>13} {'ours int4/g32':>14}   (ms per call)")
    for n, k in shapes:
        w = torch.randn(n, k) * 0.05
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        scale = w.abs().amax(1) / 127
        q8 = torch.round(w / scale[:, None]).to(torch.int8)
        int4 = _aten_int4(w)
        ours8, ours4 = quantize(w, "int8"), quantize(w, "int4")
        for m in rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            calls = [lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                     lambda x=x, q=q8, s=scale: torch.ops.aten._weight_int8pack_mm(x, q, s),
                     lambda xb=xb, f=int4: f(xb),
                     lambda x=x, w=ours8: quant_matmul(x, w, None, 16),
                     lambda x=x, w=ours8: quant_matmul(x, w, None, 8),
                     lambda x=x, w=ours8: quant_matmul(x, w, None, 32),
                     lambda x=x, w=ours4: quant_matmul(x, w)]
            cols = [time_it(call) for call in calls]
            widths = (12, 13, 14, 13, 12, 13, 14)
            print(f"{f'{k}->{n}':>12} {m:>4} " + " ".join(f"{c * 1e3:>{w_}.3f}" for c, w_ in zip(cols, widths, strict=True)))


def model_step(model_dir: str, gguf: str | None, batches: list[int], context: int) -> None:
    """ms per decode step of the whole model (B sequences of `context` tokens, one new token each)."""
    from kernels import get_backend
    from worker_svc.model_loader.loader import load_model
    from worker_svc.models.common import AttentionMetadata
    from worker_svc.models.packed_linear import pack_linear_weights

    variants = [("fp32 packed", model_dir, None), ("int8 (at load)", model_dir, "int8"),
                ("int4 (at load)", model_dir, "int4")]
    if gguf:
        variants.append((f"GGUF as stored ({gguf.rsplit('/', 1)[-1]})", gguf, "gguf"))
    backend = get_backend("cpu")
    print(f"{'weights':>44} " + " ".join(f"{f'B={b} ms':>10}" for b in batches))
    for label, path, quantization in variants:
        model, cfg = load_model(path, torch.float32, "cpu", quantization=quantization)
        pack_linear_weights(model)  # the float linears left (all of them for fp32), as the worker does
        bs = 16
        per_seq = (context + bs) // bs
        times = []
        for b in batches:
            shape = (b * per_seq, bs, cfg.num_kv_heads, cfg.head_dim)
            caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
            tables = torch.arange(b * per_seq, dtype=torch.int32).reshape(b, per_seq)
            pos = torch.full((b,), context, dtype=torch.long)
            attn = AttentionMetadata(
                slot_mapping=(tables[:, context // bs].long() * bs + context % bs),
                block_tables=tables, seq_lens=torch.full((b,), context + 1, dtype=torch.int32),
                query_start_loc=torch.arange(b + 1, dtype=torch.int32), max_query_len=1,
                max_seq_len=context + 1, backend=backend)
            ids = torch.randint(0, cfg.vocab_size, (b,))
            with torch.inference_mode():
                step = lambda model=model, ids=ids, pos=pos, attn=attn, caches=caches: model.compute_logits(  # noqa: E731
                    model(ids, pos, attn, caches))
                times.append(time_it(step, 1.0))
        print(f"{label:>44} " + " ".join(f"{t * 1e3:>10.2f}" for t in times))
        del model


def requantize(src: str, dst: str, type_name: str) -> None:
    """An F32/F16 GGUF's matrices re-written as `type_name` (norms stay F32, as llama-quantize keeps
    them), every metadata key copied: a Q8_0 file to measure with when llama.cpp's is not at hand."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():  # as gguf's own scripts/gguf_new_metadata.py copies them
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    qtype = gguf.GGMLQuantizationType[type_name]
    for t in reader.tensors:
        data = np.asarray(t.data).astype(np.float32).reshape([int(d) for d in reversed(t.shape.tolist())])
        if data.ndim == 2:
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


COLD_SHAPES = [(49152, 576), (3072, 576), (576, 1536), (576, 576)]  # lm_head, gate_up, down, o_proj
COLD_BYTES = 512 << 20  # copies of each shape, cycled: ~2 x 256 MB, past any cache


def cold_table(rows: list[int]) -> None:
    """Row-major against interleaved Q8_0-format weights, each call on cold weights: microseconds
    a call (best of 5 passes over the copies) and GB/s of weight bytes."""
    from worker_svc.model_loader.quant_format import QuantizedWeight

    print(f"{'shape':>14} {'M':>3} {'row-major us':>13} {'GB/s':>6} {'interleaved us':>15} {'GB/s':>6}")
    for n, k in COLD_SHAPES:
        w = quantize(torch.randn(n, k) * 0.05, "int8")
        copies = max(2, COLD_BYTES // 2 // (n * k))
        plain = [QuantizedWeight(w.qweight.clone(), w.scales.half(), None, 8, 32) for _ in range(copies)]
        inter = [q.interleave_rows() for q in plain]
        for m in rows:
            x = torch.randn(m, k)
            cells = []
            for weights in (plain, inter):
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    for q in weights:
                        quant_matmul(x, q)
                    best = min(best, (time.perf_counter() - start) / copies)
                cells += [f"{best * 1e6:13.0f}", f"{plain[0].nbytes / best / 1e9:6.1f}"]
            print(f"{f'{n}x{k}':>14} {m:>3} {cells[0]} {cells[1]} {cells[2]:>15} {cells[3]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_linear", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128])
    p.add_argument("--lm-head", action="store_true", help="only the 576->49152 shape (the tied lm_head)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--model-step", action="store_true", help="time the whole model's decode step instead")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--gguf", default="models/.cache/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=256, help="--model-step: tokens already cached per sequence")
    p.add_argument("--cold", action="store_true", help="row-major against interleaved 8-bit rows, cold weights")
    p.add_argument("--requantize", nargs=3, metavar=("SRC", "DST", "TYPE"),
                   help="write SRC (an F32/F16 GGUF) as DST with its matrices in TYPE (Q8_0, Q4_0, Q4_1)")
    args = p.parse_args(argv)
    if args.requantize:
        requantize(*args.requantize)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.cold:
        with torch.inference_mode():
            cold_table(args.rows)
    elif args.model_step:
        model_step(args.model, args.gguf, args.batches, args.context)
    else:
        with torch.inference_mode():
            layer_table(args.rows, SHAPES[-1:] if args.lm_head else SHAPES)


if __name__ == "__main__":
    main()
