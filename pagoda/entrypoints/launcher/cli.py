"""The launcher's command line: its flags, and `main`, which checks the ports, starts each child in
order (each must answer its health check before the next starts), supervises them, and stops them
in reverse order on Ctrl-C / SIGTERM / SIGHUP / SIGQUIT (a second one skips the drains)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from pagoda.entrypoints.launcher.supervisor import STOP_MARGIN_S, say, supervise, wait_ready
from pagoda.entrypoints.launcher.topology import build_children, print_addresses, taken_ports
from worker_svc.config import DTYPES, KV_CACHE_DTYPES

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagoda.entrypoints.launcher",
                                description="The whole Pagoda stack on 127.0.0.1: worker, scheduler, gateway.")
    p.add_argument("--model", default="models/smollm2-135m-instruct",
                   help="an HF-format model directory or a .gguf file (`make model` writes the default)")
    p.add_argument("--fake", action="store_true", help="a model-less worker (deterministic fake tokens)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="worker + scheduler replicas behind the one gateway (replica i: port flags + 10·i)")
    p.add_argument("--routing-policy", choices=("prefix", "round-robin", "least-loaded"), default=None,
                   help="the gateway's replica routing (default: prefix with several replicas)")
    p.add_argument("--extra-model", action="append", default=[], metavar="[NAME=]PATH",
                   help="one more worker + scheduler pair serving PATH, the gateway's pool for model NAME "
                        "(default: PATH's file name); repeatable")
    p.add_argument("--fallback-model", action="append", default=[], metavar="A=B",
                   help="the gateway serves model B when model A's pool is unavailable or shedding")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the worker's compute dtype (auto: the checkpoint's, fp32 for a quantised GGUF)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the worker's KV cache: auto (the compute dtype) or FP8 (one byte per value)")
    p.add_argument("--swap-space", type=float, default=0.0, metavar="GiB",
                   help="the worker's host memory for KV swapped out at preemption (default 0: none)")
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None,
                   help="the scheduler's: recompute or swap a preempted sequence (default: by cost)")
    p.add_argument("--worker-port", type=int, default=50061)
    p.add_argument("--scheduler-port", type=int, default=50052)
    p.add_argument("--gateway-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--no-gateway", action="store_true")
    p.add_argument("--speculative-config", default=None,
                   help="the scheduler's n-gram speculative decoding, as JSON (see its --help)")
    p.add_argument("--api-keys", default=None, help="the gateway's tenant key file (JSON Lines)")
    p.add_argument("--enable-lora", action="store_true", help="LoRA adapters (implied by --lora-modules)")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds the gateway and the scheduler may each drain requests in flight")
    args = p.parse_args(argv)
    if args.data_parallel_size < 1:
        p.error("--data-parallel-size must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    taken = taken_ports(args)
    if taken:
        print(f"[launcher] address in use on 127.0.0.1: {', '.join(taken)}. Is another Pagoda running? "
              "Stop it, or choose other ports with those flags.", file=sys.stderr)
        return 1
    children = build_children(args)
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame) -> None:
        if stop.is_set() and not hurry.is_set():
            hurry.set()  # a second Ctrl-C: no more waiting for drains
            say(f"{signal.Signals(signum).name} again: killing the services now")
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    code = 1
    try:
        for child in children:
            child.start()
            if not wait_ready(child, stop, args.startup_timeout):
                return 1 if not stop.is_set() else 0
        print_addresses(args, children)
        code = supervise(children, stop, args.startup_timeout)
    finally:
        for child in reversed(children):  # gateway, scheduler, worker: each drains before the next
            child.stop(args.shutdown_timeout + STOP_MARGIN_S, hurry)
        left = [c.name for c in children if c.alive()]  # by construction none: said if ever not
        say(f"stopped; still running: {left}" if left else "stopped")
    return code
