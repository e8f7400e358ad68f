"""`python -m pagoda.launcher --model DIR` (what `make run` calls): the whole stack on 127.0.0.1.

Starts the worker, the scheduler and (when gateway/__main__.py exists) the gateway as separate
processes, waits until each answers grpc.health.v1, prints the addresses, restarts a child that
dies (the scheduler reconnects to a restarted worker and recomputes), and stops everything in
reverse order on Ctrl-C / SIGTERM: the gateway drains first, then the scheduler, then the worker.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.runtime.healthcheck import check_serving
from pagoda.runtime.model_files import is_gguf_file
from worker_svc.config import DTYPES

REPO = Path(__file__).resolve().parents[1]
MAX_RESTARTS = 5  # per child within RESTART_WINDOW_S; beyond that the launcher gives up
RESTART_WINDOW_S = 60.0
STOP_MARGIN_S = 10.0  # beyond --shutdown-timeout: the drain's grace period and the exit itself



def stop_process(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM (the services drain on it), then SIGKILL if it has not exited within timeout_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode

@dataclass
class Child:
    name: str
    argv: list[str]
    health_target: str
    needs_serving: bool  # False: "answers health" is enough (a worker is NOT_SERVING until Init)
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    def start(self) -> None:
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which then stops
        # the children in order (all at once, the worker would die under a draining scheduler).
        self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], cwd=REPO, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        serving, status = check_serving(self.health_target, timeout_s=1.0)
        if self.needs_serving:
            return serving
        return serving or status == "NOT_SERVING"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s)


def build_children(args: argparse.Namespace) -> list[Child]:
    worker = f"127.0.0.1:{args.worker_port}"
    scheduler = f"127.0.0.1:{args.scheduler_port}"
    # A fake worker still reads the model directory when there is one: its vocabulary size for the
    # worker, its tokenizer for the gateway (fake token ids must decode).
    has_model = Path(args.model).is_dir() or is_gguf_file(args.model)
    model_dir = ["--model", args.model] if has_model or not args.fake else []
    model = ["--fake", *model_dir] if args.fake else model_dir
    drain = ["--shutdown-timeout", str(args.shutdown_timeout)]
    children = [
        Child("worker", ["worker_svc", *model, "--port", str(args.worker_port),
                         "--tensor-parallel-size", str(args.tensor_parallel_size),
                         "--device", args.device, "--dtype", args.dtype], worker, needs_serving=False),
        Child("scheduler", ["scheduler_svc", "--workers", worker, "--port", str(args.scheduler_port),
                            *drain], scheduler, needs_serving=True),
    ]
    if (REPO / "gateway" / "__main__.py").exists() and not args.no_gateway:
        tokenizer = ["--tokenizer", args.model] if model_dir else []
        children.append(Child("gateway", ["gateway", "--scheduler", scheduler, "--port", str(args.gateway_port),
                                          "--grpc-port", str(args.grpc_port), *tokenizer, *drain],
                              f"127.0.0.1:{args.grpc_port}", needs_serving=True))
    return children


def wait_ready(child: Child, stop: threading.Event, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while not stop.is_set():
        if not child.alive():
            print(f"[launcher] {child.name} exited with {child.proc.returncode}", file=sys.stderr)
            return False
        if child.ready():
            return True
        if time.monotonic() > end:
            print(f"[launcher] {child.name} not ready after {deadline_s:.0f}s", file=sys.stderr)
            return False
        stop.wait(0.2)  # poll interval, bounded by the deadline
    return False


def supervise(children: list[Child], stop: threading.Event, deadline_s: float) -> int:
    """Restart dead children until stopped; 1 if one keeps dying."""
    while not stop.wait(0.5):
        for child in children:
            if child.alive():
                continue
            now = time.monotonic()
            child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(child.restarts) > MAX_RESTARTS:
                print(f"[launcher] {child.name} died {MAX_RESTARTS} times in {RESTART_WINDOW_S:.0f}s; "
                      "giving up", file=sys.stderr)
                return 1
            print(f"[launcher] {child.name} died ({child.proc.returncode}); restarting", file=sys.stderr)
            child.start()
            wait_ready(child, stop, deadline_s)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagoda.launcher", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct",
                   help="an HF-format model directory or a .gguf file (`make model` writes the default)")
    p.add_argument("--fake", action="store_true", help="a model-less worker (deterministic fake tokens)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the worker's compute dtype (auto: the checkpoint's, fp32 for a quantised GGUF)")
    p.add_argument("--worker-port", type=int, default=50061)
    p.add_argument("--scheduler-port", type=int, default=50052)
    p.add_argument("--gateway-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--no-gateway", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds the gateway and the scheduler may each drain requests in flight")
    return p.parse_args(argv)


def taken_ports(args: argparse.Namespace) -> list[str]:
    """The launcher's ports that something already listens on, as 'flag PORT' lines. Checked before
    any child starts: otherwise the readiness probes would find the *other* stack's servers and
    report this one as serving while its children die on 'address in use'."""
    ports = {"--worker-port": args.worker_port, "--scheduler-port": args.scheduler_port}
    if not args.no_gateway:
        ports |= {"--gateway-port": args.gateway_port, "--grpc-port": args.grpc_port}
    taken = []
    for flag, port in ports.items():
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "taken"
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.append(f"{flag} {port}")
    return taken


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    taken = taken_ports(args)
    if taken:
        print(f"[launcher] address in use on 127.0.0.1: {', '.join(taken)}. Is another Pagoda running? "
              "Stop it, or choose other ports with those flags.", file=sys.stderr)
        return 1
    children = build_children(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
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
            child.stop(args.shutdown_timeout + STOP_MARGIN_S)
        print("[launcher] stopped", file=sys.stderr)
    return code


def print_addresses(args: argparse.Namespace, children: list[Child]) -> None:
    lines = [f"  worker     grpc  127.0.0.1:{args.worker_port}",
             f"  scheduler  grpc  127.0.0.1:{args.scheduler_port}  (pagoda.v1.Engine)"]
    if any(c.name == "gateway" for c in children):
        lines += [f"  gateway    http  http://127.0.0.1:{args.gateway_port}/v1  (OpenAI API)",
                  f"  gateway    grpc  127.0.0.1:{args.grpc_port}"]
    print("Pagoda is serving:\n" + "\n".join(lines) + "\nCtrl-C stops everything.", flush=True)



if __name__ == "__main__":
    sys.exit(main())
