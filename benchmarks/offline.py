"""Offline throughput: Pagoda's `LLM.generate` against HF transformers on the same workload.

    python -m benchmarks.offline [--model DIR] [--dataset random|sharegpt-like|prefix-repetition]
                                 [--num-prompts N] [--length-scale F] [--out results.json] [--plot out.png]

Every system generates exactly each request's max_tokens (greedy, EOS ignored), so they do the
same useful work; throughput = useful output tokens / wall seconds (model loading excluded, one run).
- HF static: `generate` on padded batches of 16 in arrival order (left padding); a batch runs until
  its longest request is done, so short requests waste steps.
- HF continuous: transformers' continuous-batching manager (what `generate_batch` drives), with each
  request's own max_new_tokens; reported as unavailable when the installed version lacks it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.datasets import DATASETS, WorkItem, WorkloadSpec, make_workload
from benchmarks.result_file import write_result

DEFAULT_MODEL = "models/pagoda-bench"
STATIC_BATCH = 16


def ensure_model(model_dir: str) -> None:
    if model_dir == DEFAULT_MODEL and not (Path(model_dir) / "config.json").is_file():
        print(f"generating the bench model into {model_dir} ...", flush=True)
        subprocess.run([sys.executable, "-m", "pagoda.tools.tiny_model", "--preset", "bench", "--out", model_dir],
                       check=True)


def run_pagoda(model_dir: str, items: list[WorkItem], args: argparse.Namespace) -> float:
    from pagoda import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=args.dtype, device=args.device,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=i.max_tokens) for i in items]
    prompts = [{"prompt_token_ids": i.prompt_token_ids} for i in items]
    load_tokenizer(llm)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(i.max_tokens for i in items), "pagoda generated a different token count"
    return elapsed


def load_tokenizer(llm) -> None:
    """Load the tokenizer `generate` detokenizes with now: loading is excluded from the timing, and
    HF's runs do not detokenize at all (a lazy first load cost ~2.4 s inside the timed call)."""
    try:
        _ = llm.tokenizer
    except (OSError, ValueError):  # no tokenizer in the model directory: generate returns ids only
        pass


def load_hf(model_dir: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()


@torch.inference_mode()
def run_hf_static(model, items: list[WorkItem]) -> float:
    started = time.perf_counter()
    for first in range(0, len(items), STATIC_BATCH):
        batch = items[first:first + STATIC_BATCH]
        width = max(len(i.prompt_token_ids) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, item in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[row, width - len(item.prompt_token_ids):] = torch.tensor(item.prompt_token_ids)
            mask[row, width - len(item.prompt_token_ids):] = 1
        new_tokens = max(i.max_tokens for i in batch)
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=0, temperature=None, top_p=None,
                       top_k=None)
    return time.perf_counter() - started


@torch.inference_mode()
def run_hf_continuous(model, items: list[WorkItem]) -> float | str:
    """Seconds, or why it could not run."""
    if not hasattr(model, "init_continuous_batching"):
        return "unavailable: this transformers has no continuous batching (generate_batch)"
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(i.max_tokens for i in items),
                              eos_token_id=-1, pad_token_id=0)
    try:
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        started = time.perf_counter()
        for n, item in enumerate(items):
            manager.add_request(item.prompt_token_ids, request_id=f"r{n}", max_new_tokens=item.max_tokens,
                                eos_token_id=-1)
        finished = 0
        while finished < len(items):
            result = manager.get_result(timeout=60)
            if result is None:
                return "failed: the continuous-batching manager stopped answering"
            finished += int(result.is_finished())
        elapsed = time.perf_counter() - started
        manager.stop(block=True)
        return elapsed
    except Exception as error:  # an experimental API: report, do not crash the benchmark
        return f"failed: {type(error).__name__}: {error}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # every system runs with the same count
    torch.manual_seed(0)
    ensure_model(args.model)
    from worker_svc.model_loader.model_config import ModelConfig

    config = ModelConfig.from_dir(args.model)
    spec = WorkloadSpec(dataset=args.dataset, num_prompts=args.num_prompts, vocab_size=config.vocab_size,
                        max_model_len=min(config.max_position_embeddings, 2048), seed=args.seed,
                        length_scale=args.length_scale)
    items = make_workload(spec)
    useful = sum(i.max_tokens for i in items)
    print(f"workload {args.dataset}: {len(items)} prompts, "
          f"{sum(len(i.prompt_token_ids) for i in items)} prompt tokens, {useful} output tokens; "
          f"model {args.model}; {args.device}, {torch.get_num_threads()} threads", flush=True)

    results: dict[str, float | str] = {}

    def record(name: str, value: float | str) -> None:
        results[name] = value
        print(f"  {name}: {value if isinstance(value, str) else f'{value:.2f} s'}", flush=True)

    record("pagoda LLM.generate", run_pagoda(args.model, items, args))
    hf = load_hf(args.model, args.dtype, args.device)
    record("HF generate (static, batch 16)", run_hf_static(hf, items))
    record("HF continuous batching", run_hf_continuous(hf, items))
    report(results, useful, args, spec)


def report(results: dict[str, float | str], useful: int, args: argparse.Namespace,
           spec: WorkloadSpec) -> None:
    pagoda_tps = useful / results["pagoda LLM.generate"]
    rows = []
    print(f"\n{'system':34} {'seconds':>9} {'output tok/s':>13} {'pagoda speed-up':>16}")
    for name, value in results.items():
        if isinstance(value, str):
            print(f"{name:34} {value}")
            rows.append({"system": name, "note": value})
            continue
        tps = useful / value
        print(f"{name:34} {value:9.2f} {tps:13.1f} {pagoda_tps / tps:15.2f}x")
        rows.append({"system": name, "seconds": value, "output_tokens_per_s": tps})
    if args.out:
        write_result(args.out, {"workload": asdict(spec), "output_tokens": useful, "results": rows})
    if args.plot:
        plot(rows, args.plot, args)


def plot(rows: list[dict], path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "output_tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["system"] for r in measured], [r["output_tokens_per_s"] for r in measured])
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"Offline throughput ({args.device})")
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dataset", choices=DATASETS, default="sharegpt-like")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--length-scale", type=float, default=0.25,
                        help="scales every length of the dataset (1.0 = full ShareGPT-like lengths)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where Pagoda's worker and HF's model run")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads for every system (0: torch's default). On a shared "
                             "or small machine 1 avoids OpenMP threads spinning against each other")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
