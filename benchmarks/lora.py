"""Multi-LoRA throughput: 4 adapters mixed in one batch against the base model alone, same workload.

    python -m benchmarks.lora [--model models/smollm2-135m-instruct] [--rank 16] [--num-prompts 32]

Two engines on the same weights, offline (`LLM`), fp32 by default: the plain one (no --enable-lora)
runs every prompt on the base model; the LoRA one (max_loras 4) runs prompt i under adapter i % 4,
so every step mixes the four. The adapters are random PEFT directories written here (rank `--rank`,
all seven target modules unless `--targets` says otherwise: the most LoRA work per token). Random
token prompts, greedy, `ignore_eos` and prefix caching off, so both engines compute exactly the same
number of tokens. Output tokens/s, best of `--repeats` (3) interleaved runs after one warm-up each; the
goal is LoRA >= 80% of base. Writes benchmarks/results/lora.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.datasets import WorkloadSpec, make_workload
from benchmarks.result_file import write_result
from pagoda.contract.lora import SUPPORTED_TARGETS, LoRARequest
from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from pagoda.tools.default_model import DEFAULT_OUT
from worker_svc.lora.weights import PEFT_TO_FUSED, fused_shapes
from worker_svc.model_loader.model_config import ModelConfig

NUM_ADAPTERS = 4
GOAL = 0.80


def write_random_adapter(model_dir: str, out: Path, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A PEFT-format LoRA directory with random A and B (what a fine-tune looks like to the server)."""
    cfg = ModelConfig.from_dir(model_dir)
    shapes = fused_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            proj, sub = PEFT_TO_FUSED[module]
            in_features, out_features = shapes[proj].in_features, shapes[proj].sub_out[sub]
            part = "self_attn" if proj in ("qkv", "o") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) / rank**0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "base_model_name_or_path": model_dir}, indent=2))
    return out


def timed_run(llm: LLM, prompts: list[dict], params: list[SamplingParams], loras) -> tuple[float, int]:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = ModelConfig.from_dir(args.model)
    items = make_workload(WorkloadSpec(dataset="random", num_prompts=args.num_prompts,
                                       vocab_size=cfg.vocab_size, input_len=args.input_len,
                                       output_len=args.output_len, seed=0))
    prompts = [{"prompt_token_ids": list(item.prompt_token_ids)} for item in items]
    params = [SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True) for item in items]
    targets = tuple(args.targets.split(","))
    common = dict(dtype=args.dtype, device="cpu", enable_prefix_caching=False, max_num_seqs=args.num_prompts,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"adapter-{i}", i + 1, str(write_random_adapter(
            args.model, Path(tmp) / f"adapter-{i}", args.rank, targets, seed=i))) for i in range(NUM_ADAPTERS)]
        loras = [adapters[i % NUM_ADAPTERS] for i in range(len(prompts))]
        engines = {"base": (LLM(args.model, **common), None),
                   "4 adapters": (LLM(args.model, enable_lora=True, max_loras=NUM_ADAPTERS,
                                      max_lora_rank=args.rank, **common), loras)}
        for llm, engine_loras in engines.values():  # warm-up: adapters loaded, kernels built
            timed_run(llm, prompts[:NUM_ADAPTERS], params[:NUM_ADAPTERS], engine_loras and engine_loras[:NUM_ADAPTERS])
        best: dict[str, float] = {}
        for repeat in range(args.repeats):
            for name, (llm, engine_loras) in engines.items():
                elapsed, tokens = timed_run(llm, prompts, params, engine_loras)
                best[name] = max(best.get(name, 0.0), tokens / elapsed)
                print(f"run {repeat + 1} {name:>10}: {tokens} output tokens in {elapsed:.2f} s = "
                      f"{tokens / elapsed:.1f} tok/s", flush=True)
    ratio = best["4 adapters"] / best["base"]
    print(f"\nmulti-LoRA, {args.model}, {args.dtype}, {args.num_prompts} prompts x ~{args.input_len} in / "
          f"~{args.output_len} out, rank {args.rank}, targets {args.targets}")
    print(f"  base model alone : {best['base']:8.1f} output tok/s")
    print(f"  4 adapters mixed : {best['4 adapters']:8.1f} output tok/s")
    print(f"  ratio            : {ratio:8.2f}  (goal >= {GOAL:.2f}: {'met' if ratio >= GOAL else 'NOT met'})")
    results = {"model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts,
               "input_len": args.input_len, "output_len": args.output_len, "rank": args.rank,
               "targets": list(targets), "base_output_tok_s": round(best["base"], 1),
               "lora_output_tok_s": round(best["4 adapters"], 1), "ratio": round(ratio, 3),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_result(args.out, results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_OUT) if DEFAULT_OUT.exists() else "models/pagoda-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default=",".join(SUPPORTED_TARGETS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/lora.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
