"""One engine's offline run for `benchmarks.vs_vllm`, in a process of its own.

    <venv>/bin/python -m benchmarks.vs_vllm_offline --engine vllm|pagoda --model DIR --dtype DT \
        --workload workload.json --out result.json

Runs under either venv: the project's (`--engine pagoda`) or the peer's `.venv-vllm`
(`--engine vllm`), so it imports nothing of the project at module level and nothing but the
standard library besides the engine itself. The workload is a JSON list of
{"prompt_token_ids": [...], "max_tokens": n}; every request is greedy with EOS ignored, so both
engines produce exactly sum(max_tokens) tokens. Timed: one `generate` over the whole workload,
after the engine is built and one short warm-up request has run (loading, compilation and the
first call's one-off costs are reported apart, as load_s).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

from benchmarks.result_file import write_result

WARMUP_TOKENS = 4
# vLLM's CPU backend, and the environment both engines inherit: recorded with the result.
RECORDED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_SGL_KERNEL", "VLLM_ENABLE_V1_MULTIPROCESSING",
                "LD_PRELOAD", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY")


def run_vllm(args: argparse.Namespace, workload: list[dict]) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, seed=0)
    generate = functools.partial(llm.generate, use_tqdm=False)
    warm_up(generate, SamplingParams)
    load_s = time.perf_counter() - started
    elapsed, outputs = timed_generate(generate, SamplingParams, workload)
    return {"load_s": load_s, "seconds": elapsed, "output_tokens": produced(outputs),
            "engine_config": _vllm_config(llm)}


def _vllm_config(llm) -> dict:
    """What the CPU platform chose by default (it rewrites several settings at start)."""
    import vllm

    config = llm.llm_engine.vllm_config
    cache, sched = config.cache_config, config.scheduler_config
    return {"vllm_version": vllm.__version__, "max_model_len": config.model_config.max_model_len,
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "block_size": cache.block_size, "num_kv_blocks": cache.num_gpu_blocks,
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "compilation_mode": getattr(config.compilation_config.mode, "name", str(config.compilation_config.mode)),
            "compilation_backend": config.compilation_config.backend,
            "executor_backend": config.parallel_config.distributed_executor_backend}


def run_pagoda(args: argparse.Namespace, workload: list[dict]) -> dict:
    import torch

    from benchmarks.offline import load_tokenizer
    from pagoda import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device="cpu", kv_cache_memory_bytes=args.kv_cache_bytes)
    load_tokenizer(llm)  # detokenizes as vLLM does; loaded outside the timed call
    generate = functools.partial(llm.generate, use_tqdm=False)
    warm_up(generate, SamplingParams)
    load_s = time.perf_counter() - started
    elapsed, outputs = timed_generate(generate, SamplingParams, workload)
    info = llm.worker_info
    config = {"torch_threads": torch.get_num_threads(), "num_kv_blocks": info.num_blocks,
              "block_size": info.block_size, "max_model_len": info.max_model_len,
              "kv_cache_memory_bytes": args.kv_cache_bytes}
    llm.close()
    return {"load_s": load_s, "seconds": elapsed, "output_tokens": produced(outputs), "engine_config": config}


def warm_up(generate, sampling_params_cls) -> None:
    """One short request: both engines pay their first-call costs outside the timed run."""
    generate([{"prompt_token_ids": [100, 200, 300, 400]}],
             [sampling_params_cls(temperature=0.0, ignore_eos=True, max_tokens=WARMUP_TOKENS)])


def timed_generate(generate, sampling_params_cls, workload: list[dict]) -> tuple[float, list]:
    """(seconds, outputs) of one `generate` over the whole workload: greedy, EOS ignored, each
    request's own max_tokens. Either engine's `generate` and `SamplingParams` class."""
    prompts = [{"prompt_token_ids": item["prompt_token_ids"]} for item in workload]
    params = [sampling_params_cls(temperature=0.0, ignore_eos=True, max_tokens=item["max_tokens"])
              for item in workload]
    started = time.perf_counter()
    outputs = generate(prompts, params)
    return time.perf_counter() - started, outputs


def produced(outputs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("vllm", "pagoda"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="Pagoda's KV budget (vLLM: env)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = json.loads(args.workload.read_text())
    run = run_vllm if args.engine == "vllm" else run_pagoda
    result = run(args, workload)
    expected = sum(item["max_tokens"] for item in workload)
    if result["output_tokens"] != expected:
        raise SystemExit(f"{args.engine} produced {result['output_tokens']} tokens, expected {expected}")
    result.update(engine=args.engine, dtype=args.dtype, output_tokens_per_s=expected / result["seconds"],
                  env={k: os.environ[k] for k in RECORDED_ENV if k in os.environ}, cpu_count=os.cpu_count(),
                  affinity=sorted(os.sched_getaffinity(0)))
    write_result(args.out, result)
    print(f"{args.engine} {args.dtype}: {expected} tokens in {result['seconds']:.2f} s = "
          f"{result['output_tokens_per_s']:.1f} tok/s (load {result['load_s']:.1f} s)", flush=True)


if __name__ == "__main__":  # vLLM's CPU engine spawns processes: nothing may run at import time
    main()
