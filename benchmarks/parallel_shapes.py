"""TP=2, PP=2 and DP=2 against one rank, side by side: the same model, the same workload, one run.

    python -m benchmarks.parallel_shapes --model models/pagoda-bench [--shapes tp1,tp2,pp2,dp2] \
        [--num-prompts 48 --max-concurrency 16 --random-input-len 128 --random-output-len 64] \
        [--out benchmarks/results/parallel_shapes.json]

Each shape is `pagoda serve MODEL` with its flags (--tensor-parallel-size 2, --pipeline-parallel-size
2 or --data-parallel-size 2), started, driven by benchmarks.serve (random prompts sent as token
ids, EOS ignored), stopped, before the next starts. On a CPU machine the ranks or replicas share its
cores, so no shape is expected to be faster than one rank: the table shows what each costs (TP: an
all-reduce per layer; PP: a hidden-state hop per stage and the result back to rank 0, with two plans
in flight over two halves of the batch; DP: two schedulers and workers). Make the model with
`python -m pagoda.tools.tiny_model --preset bench --out models/pagoda-bench` (~104M, 12 heads / 4 KV
heads: TP=2 divides them; SmolLM2's 9 heads do not).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.peer_server import free_port, start_server, stop_server, wait_ready
from benchmarks.result_file import write_result
from benchmarks.serve import cpu_features, machine_description
from benchmarks.serve import main as serve_main

SHAPES = {
    "tp1": [],
    "tp2": ["--tensor-parallel-size", "2"],
    "pp2": ["--pipeline-parallel-size", "2"],
    "dp2": ["--data-parallel-size", "2"],
}
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parallel_shapes", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pagoda-bench")
    p.add_argument("--shapes", default="tp1,tp2,pp2,dp2", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=RESULTS / "parallel_shapes.json")
    return p.parse_args(argv)


def run_shape(name: str, args: argparse.Namespace, logs: Path) -> dict:
    gateway = free_port()
    ports = ["--gateway-port", str(gateway), "--grpc-port", str(free_port()),
             "--worker-port", str(free_port()), "--scheduler-port", str(free_port())]
    argv = [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", args.model, "--device", "cpu",
            "--dtype", args.dtype, *SHAPES[name], *ports]
    base_url = f"http://127.0.0.1:{gateway}"
    proc = start_server(argv, dict(os.environ), logs / f"{name}.log")
    try:
        ready_s, _ = wait_ready(proc, base_url, args.startup_timeout)
        result = serve_main(["--base-url", base_url, "--dataset", "random", "--num-prompts", str(args.num_prompts),
                             "--max-concurrency", str(args.max_concurrency),
                             "--random-input-len", str(args.random_input_len),
                             "--random-output-len", str(args.random_output_len), "--no-progress"])
    finally:
        stop_server(proc)
    return {"shape": name, "flags": SHAPES[name], "ready_s": round(ready_s, 1), **result}


def table(rows: list[dict]) -> str:
    base = rows[0]["output_throughput"]
    lines = [f"{'shape':<6} {'out tok/s':>10} {'vs ' + rows[0]['shape']:>8} {'TPOT p50 ms':>12} "
             f"{'TTFT p50 ms':>12} {'failed':>7} {'ready s':>8}"]
    for r in rows:
        lines.append(f"{r['shape']:<6} {r['output_throughput']:>10.1f} {r['output_throughput'] / base:>7.2f}x "
                     f"{r['median_tpot_s'] * 1e3:>12.1f} {r['median_ttft_s'] * 1e3:>12.1f} {r['failed']:>7} "
                     f"{r['ready_s']:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logs = RESULTS / "parallel_shapes_logs"
    rows = [run_shape(name, args, logs) for name in args.shapes.split(",")]
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_description(),
              "cpu": cpu_features(), "model": args.model, "dtype": args.dtype,
              "workload": {k: getattr(args, k) for k in ("num_prompts", "max_concurrency", "random_input_len",
                                                         "random_output_len")},
              "shapes": rows}
    print(table(rows))
    write_result(args.out, result)
    print(f"results written to {args.out}")
    return result


if __name__ == "__main__":
    main()
