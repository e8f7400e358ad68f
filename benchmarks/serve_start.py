"""Start-to-ready of `pagoda serve MODEL` (issue 47, item 4) and each service's RSS once ready.

    python -m benchmarks.serve_start --model models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf [--runs 2]
        [--base-port 18700] [-- extra serve flags]

Starts the launcher (worker, scheduler, gateway on 127.0.0.1 ports from --base-port), times the
moment it prints the gateway's address (every service answered its health check), prints the
worker's `model_loaded` time and every child's RSS (the worker's includes its KV cache), then
stops it with SIGTERM. Several runs: the median is the figure to quote on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time


def descendants(root: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        here = todo.pop()
        kids = [pid for pid, parent in parents.items() if parent == here]
        out += kids
        todo += kids
    return out


def rss_mib(pid: int) -> tuple[float, str]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    with open(f"/proc/{pid}/cmdline") as f:
        cmd = f.read().replace("\0", " ").split()
    name = next((c for c in cmd if c in ("worker_svc", "scheduler_svc", "gateway")), " ".join(cmd[:3]))
    return rss / 1024, name


def one_start(model: str, base: int, extra: list[str]) -> float | None:
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", model, "--worker-port", str(base + 1),
           "--scheduler-port", str(base + 2), "--gateway-port", str(base + 3), "--grpc-port", str(base + 4), *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready = None
    try:
        for line in proc.stdout:
            if '"model_loaded"' in line:
                print(f"  worker model_loaded at {time.perf_counter() - start:6.2f} s")
            if "gateway" in line and "http" in line and f":{base + 3}" in line:
                ready = time.perf_counter() - start
                break
        if ready is not None:
            print(f"  ready (addresses printed) at {ready:6.2f} s")
            for pid in descendants(proc.pid):
                try:
                    mib, name = rss_mib(pid)
                except (OSError, StopIteration):
                    continue
                if mib > 20:
                    print(f"  RSS {mib:8.1f} MiB  {name}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return ready


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--base-port", type=int, default=18700)
    p.add_argument("extra", nargs="*", help="more `pagoda serve` flags (after --)")
    args = p.parse_args()
    times = []
    for i in range(args.runs):
        print(f"run {i + 1}: pagoda serve {args.model}")
        ready = one_start(args.model, args.base_port, args.extra)
        if ready is None:
            raise SystemExit("the launcher exited before it was ready")
        times.append(ready)
    print(f"start-to-ready: median {statistics.median(times):.2f} s, min {min(times):.2f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
