"""The launcher's command line: its flags, and `main`, which checks the ports, starts each child in
order (each must answer its health check before the next starts), supervises them, and stops them
in reverse order on Ctrl-C / SIGTERM / SIGHUP / SIGQUIT (a second one skips the drains).

The flags are defined once, by `add_flags`, into groups headed "model", "worker", "scheduler",
"gateway", "ports", "process": this parser and `pagoda serve` (pagoda/entrypoints/cli/serve.py)
both take them from there."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from pagoda.entrypoints.launcher.agent_flags import add_agent_flags
from pagoda.entrypoints.launcher.supervisor import STOP_MARGIN_S, say, supervise, wait_ready
from pagoda.entrypoints.launcher.topology import build_children, print_addresses, taken_ports
from worker_svc.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
DEFAULT_MODEL = "models/smollm2-135m-instruct"
# The --help headings, in order, and what each group holds.
GROUPS = {
    "model": "what is served",
    "worker": "the worker (python -m worker_svc): device, precision, memory, LoRA",
    "scheduler": "the scheduler (python -m scheduler_svc)",
    "gateway": "the gateway (python -m gateway): the OpenAI-compatible HTTP API and its gRPC twin",
    "ports": "every service binds 127.0.0.1 (the gateway: --host); replica i takes the worker and scheduler ports + 10·i",
    "process": "replicas, start-up and shutdown",
    "nodes": "one instance over several hosts (torchrun's contract: one launch per host; docs/multi_node.md)",
}


def add_groups(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One argument group per GROUPS heading, in that order."""
    return {title: parser.add_argument_group(title, description) for title, description in GROUPS.items()}


def add_flags(groups: dict[str, argparse._ArgumentGroup], **model_overrides) -> None:
    """Every launcher flag, each into its group (keys: GROUPS); model_overrides: add_argument's
    keywords for --model (`pagoda serve` takes the model positionally too)."""
    g = groups["model"]
    g.add_argument("--model", **{
        "default": DEFAULT_MODEL,
        "help": "an HF-format model directory or a .gguf file (`make model` writes the default)", **model_overrides})
    g.add_argument("--fake", action="store_true",
                   help="a model-less worker (deterministic fake tokens); reads MODEL's vocabulary and "
                        "tokenizer when MODEL exists")
    g.add_argument("--extra-model", action="append", default=[], metavar="[NAME=]PATH",
                   help="one more worker + scheduler pair serving PATH, the gateway's pool for model NAME "
                        "(default: PATH's file name); repeatable")

    g = groups["worker"]
    g.add_argument("--device", default="auto", metavar="DEVICE", help="cpu, cuda or auto (default: auto)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the worker's compute dtype (auto: the checkpoint's, fp32 for a quantised GGUF)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the worker's KV cache: auto (the compute dtype) or FP8 (one byte per value)")
    g.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="CPU weight-only int8/int4 linears: auto (a GGUF's quantized weights as stored), "
                        "int8 / int4 (an HF directory, quantized at load), none (docs/quantization.md)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="GPUs (worker ranks) per replica (default: 1)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="pipeline stages: the layers split over N ranks (x TP), up to N plans in flight")
    g.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                   help="mp: ranks are processes (each host's launch starts its own); ray: the worker "
                        "places them as actors on the running Ray cluster (pip install 'pagoda[ray]')")
    g.add_argument("--batch-invariant", action="store_true",
                   help="CPU bf16: results independent of the batch shape (greedy outputs equal with "
                        "and without speculation), slower GEMMs")
    g.add_argument("--swap-space", type=float, default=0.0, metavar="GiB",
                   help="the worker's host memory for KV swapped out at preemption (default 0: none)")
    g.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GiB",
                   help="the worker's host memory for the prefix cache's host tier: evicted cached blocks "
                        "are copied there and back on a later hit (default 0: none)")
    g.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="the prefix cache's disk tier under the host tier: blocks it drops go to files "
                        "here, loaded back on a later hit, kept across worker restarts (default: none)")
    g.add_argument("--kv-offload-dir-size", type=float, default=8.0, metavar="GiB",
                   help="the disk tier's size cap, least recently used files first out (default 8)")
    g.add_argument("--kv-migrate-dir", default=None, metavar="DIR",
                   help="live migration: every replica's worker shares this folder, where a migrated "
                        "request's KV goes (POST /admin/migrate, /admin/drain; default: none, a moved "
                        "request recomputes)")
    g.add_argument("--kv-transfer", default="dir", choices=("dir", "grpc"),
                   help="live migration's transport between the replicas' workers: dir (--kv-migrate-dir) "
                        "or grpc (worker to worker on the workers' ports, no shared folder)")
    g.add_argument("--kv-snapshot-dir", default=None, metavar="DIR",
                   help="session save / restore: every replica's worker shares this folder of session "
                        "snapshots (POST /v1/sessions/{id}/save, /restore; default: none, they answer 400)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="the worker's KV pool in blocks, instead of its memory budget")
    g.add_argument("--pooling-type", default="last", choices=("last", "mean"),
                   help="/v1/embeddings: the last prompt position's hidden state, or the mean (default: last)")
    g.add_argument("--no-normalize-embeddings", dest="normalize_embeddings", action="store_false",
                   help="/v1/embeddings: the raw pooled vector (default: L2-normalised)")
    g.add_argument("--enable-lora", action="store_true", help="LoRA adapters (implied by --lora-modules)")
    g.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="LoRA adapters the gateway serves as model NAME")
    g.add_argument("--max-loras", type=int, default=1, metavar="N", help="adapters in one batch (default: 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, metavar="R", help="the largest adapter rank (default: 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="adapters kept in host memory (default: --max-loras)")

    g = groups["scheduler"]
    g.add_argument("--worker-timeout", type=float, default=None, metavar="S",
                   help="the scheduler's: seconds a lost worker (a dead rank restarts it) may take to come "
                        "back before its requests fail (default: the scheduler's, 30)")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None,
                   help="the scheduler's: recompute or swap a preempted sequence (default: by cost)")
    g.add_argument("--admission-order", choices=["auto", "fcfs", "cached-first"], default="auto",
                   help="the scheduler's: admit the waiting queue's head, or the earliest request with fewer "
                        "tokens to compute after its prefix hit than the head (multi-turn sessions; "
                        "default auto: cached-first with a host KV tier, else fcfs)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding (ngram, suffix, or a draft model: {\"model\": PATH or "
                        "\"self:q4\", \"num_speculative_tokens\": k}), as JSON (see the scheduler's --help)")
    g.add_argument("--tenant-kv-share", type=float, default=None, metavar="F",
                   help="the scheduler's per-tenant KV cap, a fraction of the pool (default: 1.0, none)")
    g.add_argument("--tenant-fairness", choices=["off", "vtc"], default=None,
                   help="the scheduler's admission across tenants (default: off)")

    g = groups["gateway"]
    g.add_argument("--no-gateway", action="store_true", help="start only the workers and schedulers")
    g.add_argument("--routing-policy", choices=("prefix", "round-robin", "least-loaded"), default=None,
                   help="the gateway's replica routing (default: prefix with several replicas)")
    g.add_argument("--fallback-model", action="append", default=[], metavar="A=B",
                   help="the gateway serves model B when model A's pool is unavailable or shedding")
    g.add_argument("--api-keys", default=None, metavar="FILE", help="the gateway's tenant key file (JSON Lines)")
    g.add_argument("--reasoning-parser", choices=("deepseek_r1", "qwen3"), default=None,
                   help="the gateway splits the model's <think> reasoning into reasoning_content")
    g.add_argument("--enable-request-timings", action="store_true",
                   help="the gateway adds per-request timings to its responses")
    add_agent_flags(g)  # tools on by default, --served-model-name (agent_flags.py)

    g = groups["ports"]
    g.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="the gateway's bind address, vLLM's --host (default: 127.0.0.1; 0.0.0.0 in a container "
                        "whose API is reached from outside it); the worker and the scheduler stay on 127.0.0.1")
    g.add_argument("--worker-port", type=int, default=50061, metavar="PORT", help="gRPC (default: 50061)")
    g.add_argument("--scheduler-port", type=int, default=50052, metavar="PORT", help="gRPC, pagoda.v1.Engine (default: 50052)")
    g.add_argument("--gateway-port", type=int, default=8000, metavar="PORT", help="HTTP, the OpenAI API (default: 8000)")
    g.add_argument("--grpc-port", type=int, default=50051, metavar="PORT", help="the gateway's gRPC (default: 50051)")

    g = groups["process"]
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="worker + scheduler replicas behind the one gateway (replica i: port flags + 10·i)")
    g.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                   help="seconds each service may take to answer its health check (default: 300)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="seconds the gateway and the scheduler may each drain requests in flight (default: 30)")

    g = groups["nodes"]
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="hosts the instance spans (default: 1)")
    g.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this host: 0 runs rank 0 with the scheduler and gateway; above 0 only its ranks")
    g.add_argument("--master-addr", default="127.0.0.1", metavar="ADDR",
                   help="node 0's address, where every rank meets rank 0 (default: 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="rank 0's rendezvous port (needed with --nnodes > 1)")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse itself cannot check; exits through parser.error."""
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be at least 1")
    if args.pipeline_parallel_size < 1 or args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size and --pipeline-parallel-size must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    if args.nnodes > 1 and args.master_port is None:
        parser.error("--nnodes > 1 needs --master-port (and --master-addr): where every node meets rank 0")
    if args.nnodes > 1 and (args.data_parallel_size > 1 or args.extra_model):
        parser.error("--nnodes > 1 spans one instance: no --data-parallel-size or --extra-model with it")
    if (args.tensor_parallel_size * args.pipeline_parallel_size) % args.nnodes:
        parser.error("the ranks (tensor x pipeline parallel sizes) must split evenly over --nnodes")


def build_parser(prog: str = "python -m pagoda.entrypoints.launcher") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog,
                                description="The whole Pagoda stack on 127.0.0.1: worker, scheduler, gateway.")
    add_flags(add_groups(p))
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Start the stack `args` describes, serve until a stop signal, stop it; the exit code."""
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
