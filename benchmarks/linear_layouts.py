"""aten's `linear` (row-major weight, MKL) against oneDNN with the weight pre-packed once
(worker_svc/models/packed_linear.py), and in bf16 the batch-invariant op (`--batch-invariant`,
worker_svc/models/batch_invariant_linear.py), on one model's GEMM shapes.

    .venv/bin/python -m benchmarks.linear_layouts [--model models/smollm2-135m-instruct]
        [--rows 1 16 64 512 2048] [--dtypes float32 bfloat16] [--threads N]

Prints ms per forward over all of the model's linear layers (one decode or prefill step's GEMMs,
lm_head included) and GFLOP/s, for each row count (tokens in the step).
"""

from __future__ import annotations

import argparse
import time

import torch

from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.models.batch_invariant_linear import BatchInvariantLinear


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of each linear layer, the fused ones as the worker holds them; lm_head last."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
                 (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    return per_layer * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]


def _as_linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    return linear


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and oneDNN primitive creation
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear_layouts", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512, 2048])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = layer_shapes(ModelConfig.from_dir(args.model))
    print(f"{args.model}: {len(shapes)} linear layers, {torch.get_num_threads()} threads")
    print(f"{'dtype':>9} {'rows':>5} {'aten ms':>9} {'packed ms':>10} {'aten GF/s':>10} {'packed GF/s':>12} "
          f"{'speed-up':>9} {'invariant ms':>13}")
    with torch.inference_mode():
        for dtype in (getattr(torch, name) for name in args.dtypes):
            weights = [torch.randn(o, i).to(dtype) for o, i in shapes]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
            invariant = ([BatchInvariantLinear(_as_linear(w)) for w in weights]
                         if dtype == torch.bfloat16 else None)
            for rows in args.rows:
                inputs = {i: torch.randn(rows, i).to(dtype) for _, i in shapes}
                flops = sum(2 * rows * o * i for o, i in shapes)
                repeats = max(1, min(20, 20_000 // max(rows, 1)))
                aten = time_it(lambda inputs=inputs, weights=weights: [
                    torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights], repeats)
                onednn = time_it(lambda inputs=inputs, packed=packed: [torch.ops.mkldnn._linear_pointwise(
                    inputs[w.shape[1]], w, None, "none", [], "") for w in packed], repeats)
                bi = "" if invariant is None else f"{time_it(lambda inputs=inputs, invariant=invariant: [layer(inputs[layer.in_features]) for layer in invariant], repeats) * 1e3:.1f}"
                print(f"{str(dtype).removeprefix('torch.'):>9} {rows:>5} {aten * 1e3:>9.1f} {onednn * 1e3:>10.1f} "
                      f"{flops / aten / 1e9:>10.0f} {flops / onednn / 1e9:>12.0f} {aten / onednn:>8.2f}× {bi:>13}")


if __name__ == "__main__":
    main()
