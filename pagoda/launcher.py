"""`python -m pagoda.launcher --model DIR` (what `make run` calls): the whole stack on 127.0.0.1.

Starts the worker, the scheduler and (when gateway/__main__.py exists) the gateway as separate
processes (with `--data-parallel-size N`: N worker + scheduler pairs, replica i on the port flags
+ 10·i, and one gateway routing over all N schedulers; each `--extra-model` adds one more pair
serving another model, the gateway's pool for that model name), waits until each answers grpc.health.v1, prints the addresses, restarts a child that
dies (the scheduler reconnects to a restarted worker and recomputes), and stops everything in
reverse order on Ctrl-C / SIGTERM / SIGHUP / SIGQUIT: the gateway drains first, then the
scheduler, then the worker.

No child outlives the launcher: each is stopped with SIGTERM, waited for, and SIGKILLed if it has
not exited in time; then what it started itself (its process group) is waited for and killed too.
A second Ctrl-C skips the drains (SIGKILL at once). Should the launcher itself die without
stopping them (SIGKILL), Linux sends each child SIGTERM (PR_SET_PDEATHSIG, which each service sets
itself when it finds PAGODA_LAUNCHER_PID: pagoda/runtime/shutdown.py).
"""

from __future__ import annotations

import argparse
import os
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
from pagoda.runtime.shutdown import EXIT_MARGIN_S, LAUNCHER_PID_ENV
from worker_svc.config import DTYPES, KV_CACHE_DTYPES

REPO = Path(__file__).resolve().parents[1]
MAX_RESTARTS = 5  # per child within RESTART_WINDOW_S; beyond that the launcher gives up
RESTART_WINDOW_S = 60.0
# Beyond --shutdown-timeout. A child's own exit watchdog fires at EXIT_MARGIN_S (it dumps its
# stacks and exits 1); the launcher's SIGKILL comes after that, as the last resort.
STOP_MARGIN_S = EXIT_MARGIN_S + 5.0
GROUP_EXIT_S = 5.0  # what a child started itself gets this long to follow it, then SIGKILL
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _say(message: str) -> None:
    """A launcher line on stderr; never raises (a closed terminal must not abort the stop)."""
    try:
        print(f"[launcher] {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def stop_process(proc: subprocess.Popen, timeout_s: float, hurry: threading.Event | None = None) -> int:
    """SIGTERM (the services drain on it), then SIGKILL if it has not exited within timeout_s, or
    as soon as `hurry` is set. Returns the exit code (negative: the signal that ended it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < end and not (hurry and hurry.is_set()):
            try:
                proc.wait(min(0.2, max(end - time.monotonic(), 0.0)))  # bounded: re-checks hurry
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`, from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # fields after "(comm)": state, ppid, pgrp, ...
            state, _ppid, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # exited meanwhile
            continue
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def reap_group(pgid: int, timeout_s: float = GROUP_EXIT_S) -> list[int]:
    """After a group leader exited: wait for the rest of its group (the processes it started,
    e.g. tensor-parallel ranks), SIGKILL what is still there. Returns the pids that had to be
    killed. A group id stays reserved while any member lives, so this never hits a stranger."""
    if not Path("/proc").is_dir():
        return []
    end = time.monotonic() + timeout_s
    while (left := group_members(pgid)) and time.monotonic() < end:
        time.sleep(0.05)  # poll interval; bounded by timeout_s
    if left:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return []
        end = time.monotonic() + 2.0
        while group_members(pgid) and time.monotonic() < end:
            time.sleep(0.05)  # SIGKILL is not instant either
    return left


@dataclass
class Child:
    name: str
    argv: list[str]
    health_target: str
    needs_serving: bool  # False: "answers health" is enough (a worker is NOT_SERVING until Init)
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment

    def start(self) -> None:
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which then stops
        # the children in order (all at once, the worker would die under a draining scheduler).
        # Its process group then holds what it starts itself, for `reap_group`. No preexec_fn:
        # subprocess would fork() rather than vfork(), and gRPC's fork handlers can hang that.
        self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], cwd=REPO, start_new_session=True,
                                     env={**os.environ, **self.env, LAUNCHER_PID_ENV: str(os.getpid())})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        serving, status = check_serving(self.health_target, timeout_s=1.0)
        if self.needs_serving:
            return serving
        return serving or status == "NOT_SERVING"

    def stop(self, timeout_s: float = 10.0, hurry: threading.Event | None = None) -> None:
        """Stop it and everything it started; says how each ended."""
        if self.proc is None:
            return
        started = time.monotonic()
        was_running = self.proc.poll() is None
        code = stop_process(self.proc, timeout_s, hurry)
        how = f"exited ({code})" if code != -signal.SIGKILL else "killed (SIGKILL)"
        if was_running:
            _say(f"{self.name} {how} after {time.monotonic() - started:.1f}s")
        if stragglers := reap_group(self.proc.pid):
            _say(f"{self.name}: killed {len(stragglers)} process(es) it left behind: {stragglers}")


REPLICA_PORT_STRIDE = 10  # replica i: --worker-port + 10·i, --scheduler-port + 10·i


def replica_ports(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(worker port, scheduler port) of each replica: the data-parallel ones, then one per extra model."""
    return [(args.worker_port + REPLICA_PORT_STRIDE * i, args.scheduler_port + REPLICA_PORT_STRIDE * i)
            for i in range(args.data_parallel_size + len(args.extra_model))]


def replica_models(args: argparse.Namespace) -> list[tuple[str | None, str]]:
    """(pool name, model path) of each replica: None (the default pool) for the data-parallel ones,
    then each --extra-model [NAME=]PATH (name: the path's file name without .gguf)."""
    extra = []
    for text in args.extra_model:
        name, _, path = text.rpartition("=")
        extra.append((name or Path(path).name.removesuffix(".gguf"), path))
    return [(None, args.model)] * args.data_parallel_size + extra


def replica_devices(args: argparse.Namespace, replica: int) -> dict[str, str]:
    """With several replicas on GPUs (extra models' too): replica i sees GPUs [i·tp, (i+1)·tp) of the
    visible ones."""
    replicas = len(replica_ports(args))
    if replicas == 1 or args.device == "cpu":
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(replicas * args.tensor_parallel_size)]
    mine = gpus[replica * args.tensor_parallel_size:(replica + 1) * args.tensor_parallel_size]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)} if mine else {}


def build_children(args: argparse.Namespace) -> list[Child]:
    """Worker, scheduler per replica, then the gateway over every scheduler."""
    children: list[Child] = []
    schedulers = []
    several = len(replica_ports(args)) > 1
    for i, ((worker_port, scheduler_port), (pool, model)) in enumerate(
            zip(replica_ports(args), replica_models(args), strict=True)):
        suffix = f"[{i}]" if several else ""
        pair = _replica_children(args, model, worker_port, scheduler_port, suffix)
        pair[0].env = replica_devices(args, i)
        children += pair
        schedulers.append(f"{pool}=127.0.0.1:{scheduler_port}" if pool else f"127.0.0.1:{scheduler_port}")
    if (REPO / "gateway" / "__main__.py").exists() and not args.no_gateway:
        has_model = Path(args.model).is_dir() or is_gguf_file(args.model)
        tokenizer = ["--tokenizer", args.model] if has_model or not args.fake else []
        drain = ["--shutdown-timeout", str(args.shutdown_timeout)]
        api_keys = ["--api-keys", args.api_keys] if args.api_keys else []
        routing = ["--routing-policy", args.routing_policy] if args.routing_policy else []
        fallbacks = [flag for pair in args.fallback_model for flag in ("--fallback-model", pair)]
        loras = ["--lora-modules", *args.lora_modules] if args.lora_modules else []
        children.append(Child("gateway", ["gateway", "--scheduler", ",".join(schedulers),
                                          "--port", str(args.gateway_port),
                                          "--grpc-port", str(args.grpc_port), *tokenizer, *drain,
                                          *api_keys, *routing, *fallbacks, *loras],
                              f"127.0.0.1:{args.grpc_port}", needs_serving=True))
    return children


def _replica_children(args: argparse.Namespace, model_path: str, worker_port: int, scheduler_port: int,
                      suffix: str) -> list[Child]:
    worker = f"127.0.0.1:{worker_port}"
    scheduler = f"127.0.0.1:{scheduler_port}"
    # A fake worker still reads the model directory when there is one: its vocabulary size for the
    # worker, its tokenizer for the gateway (fake token ids must decode).
    has_model = Path(model_path).is_dir() or is_gguf_file(model_path)
    model_dir = ["--model", model_path] if has_model or not args.fake else []
    model = ["--fake", *model_dir] if args.fake else model_dir
    drain = ["--shutdown-timeout", str(args.shutdown_timeout)]
    spec = ["--speculative-config", args.speculative_config] if args.speculative_config else []
    swap = ["--swap-space", str(args.swap_space)] if args.swap_space else []
    preemption = ["--preemption-mode", args.preemption_mode] if args.preemption_mode else []
    lora = ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank),
            *(["--max-cpu-loras", str(args.max_cpu_loras)] if args.max_cpu_loras else [])
            ] if args.enable_lora or args.lora_modules else []
    return [
        Child(f"worker{suffix}", ["worker_svc", *model, "--port", str(worker_port),
                                  "--tensor-parallel-size", str(args.tensor_parallel_size),
                                  "--device", args.device, "--dtype", args.dtype,
                                  "--kv-cache-dtype", args.kv_cache_dtype, *swap, *lora], worker,
              needs_serving=False),
        Child(f"scheduler{suffix}", ["scheduler_svc", "--workers", worker, "--port", str(scheduler_port),
                                     *drain, *spec, *preemption], scheduler, needs_serving=True),
    ]


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


def taken_ports(args: argparse.Namespace) -> list[str]:
    """The launcher's ports that something already listens on, as 'flag PORT' lines. Checked before
    any child starts: otherwise the readiness probes would find the *other* stack's servers and
    report this one as serving while its children die on 'address in use'."""
    ports = {}
    for i, (worker_port, scheduler_port) in enumerate(replica_ports(args)):
        offset = f" + {REPLICA_PORT_STRIDE * i}" if i else ""  # extra models follow the replicas
        ports |= {f"--worker-port{offset}": worker_port, f"--scheduler-port{offset}": scheduler_port}
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
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame) -> None:
        if stop.is_set() and not hurry.is_set():
            hurry.set()  # a second Ctrl-C: no more waiting for drains
            _say(f"{signal.Signals(signum).name} again: killing the services now")
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
        _say(f"stopped; still running: {left}" if left else "stopped")
    return code


def print_addresses(args: argparse.Namespace, children: list[Child]) -> None:
    lines = []
    for i, ((worker_port, scheduler_port), (pool, _)) in enumerate(
            zip(replica_ports(args), replica_models(args), strict=True)):
        replica = f"  (model {pool})" if pool else f"  (replica {i})" if args.data_parallel_size > 1 else ""
        lines += [f"  worker     grpc  127.0.0.1:{worker_port}{replica}",
                  f"  scheduler  grpc  127.0.0.1:{scheduler_port}  (pagoda.v1.Engine){replica}"]
    if any(c.name == "gateway" for c in children):
        lines += [f"  gateway    http  http://127.0.0.1:{args.gateway_port}/v1  (OpenAI API)",
                  f"  gateway    grpc  127.0.0.1:{args.grpc_port}"]
    print("Pagoda is serving:\n" + "\n".join(lines) + "\nCtrl-C stops everything.", flush=True)



if __name__ == "__main__":
    sys.exit(main())
