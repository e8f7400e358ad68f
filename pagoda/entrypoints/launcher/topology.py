"""Which children the launcher starts: one worker + scheduler pair per replica (data-parallel
replicas, then one per --extra-model), one gateway over every scheduler; their ports, model paths
and visible GPUs, and whether those ports are free."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from pagoda.entrypoints.launcher.agent_flags import gateway_agent_argv
from pagoda.entrypoints.launcher.supervisor import REPO, Child
from pagoda.runtime.model_files import is_gguf_file

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
    visible ones. On CPU each replica's worker takes its share of the host's cores (OMP_NUM_THREADS):
    each taking all of them oversubscribed a 2-core machine 2x at DP=2 (benchmarks.parallel_shapes)."""
    replicas = len(replica_ports(args))
    if replicas == 1:
        return {}
    if args.device == "cpu":
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // replicas))}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(replicas * args.tensor_parallel_size)]
    mine = gpus[replica * args.tensor_parallel_size:(replica + 1) * args.tensor_parallel_size]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)} if mine else {}


def distributed_flags(args: argparse.Namespace) -> list[str]:
    """The worker's pipeline / multi-node flags, only where they differ from one local rank."""
    flags = []
    if args.pipeline_parallel_size != 1:
        flags += ["--pipeline-parallel-size", str(args.pipeline_parallel_size)]
    if args.distributed_executor_backend != "mp":
        flags += ["--distributed-executor-backend", args.distributed_executor_backend]
    if args.nnodes > 1:
        flags += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
                  "--master-addr", args.master_addr, "--master-port", str(args.master_port)]
    return flags


def build_children(args: argparse.Namespace) -> list[Child]:
    """Worker, scheduler per replica, then the gateway over every scheduler. Node r > 0 of a
    multi-node instance: only its ranks (a worker child without a server)."""
    if args.node_rank > 0:
        model = ["--model", args.model]
        return [Child(f"worker-node{args.node_rank}",
                      ["worker_svc", *model, "--tensor-parallel-size", str(args.tensor_parallel_size),
                       "--device", args.device, "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype,
                       *distributed_flags(args)], "", needs_serving=False)]
    children: list[Child] = []
    schedulers = []
    several = len(replica_ports(args)) > 1
    for i, ((worker_port, scheduler_port), (pool, model)) in enumerate(
            zip(replica_ports(args), replica_models(args), strict=True)):
        suffix = f"[{i}]" if several else ""
        pair = _replica_children(args, model, worker_port, scheduler_port, suffix, i if several else None)
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
        reasoning = ["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else []
        timings = ["--enable-request-timings"] if args.enable_request_timings else []
        children.append(Child("gateway", ["gateway", "--scheduler", ",".join(schedulers),
                                          "--host", args.host, "--port", str(args.gateway_port),
                                          "--grpc-port", str(args.grpc_port), *gateway_agent_argv(args),
                                          *tokenizer, *drain,
                                          *api_keys, *routing, *fallbacks, *loras, *reasoning, *timings],
                              f"127.0.0.1:{args.grpc_port}", needs_serving=True))
    return children


def _replica_children(args: argparse.Namespace, model_path: str, worker_port: int, scheduler_port: int,
                      suffix: str, replica: int | None = None) -> list[Child]:
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
    invariant = ["--batch-invariant"] if args.batch_invariant else []
    swap += ["--kv-offloading-size", str(args.kv_offloading_size)] if args.kv_offloading_size else []
    if args.kv_offload_dir:  # one folder per replica: a worker locks its own (worker_svc/disk_tier/store.py)
        disk_dir = args.kv_offload_dir if replica is None else str(Path(args.kv_offload_dir) / f"replica-{replica}")
        swap += ["--kv-offload-dir", disk_dir, "--kv-offload-dir-size", str(args.kv_offload_dir_size)]
    if getattr(args, "kv_migrate_dir", None):  # one folder for all replicas: exports meet imports there
        swap += ["--kv-migrate-dir", args.kv_migrate_dir]
    if getattr(args, "kv_transfer", "dir") == "grpc":  # exports fetched from each worker's own port
        swap += ["--kv-transfer", "grpc"]
    if getattr(args, "kv_snapshot_dir", None):  # one folder for all replicas: a snapshot restores anywhere
        swap += ["--kv-snapshot-dir", args.kv_snapshot_dir]
    if args.num_gpu_blocks_override is not None:
        swap += ["--num-gpu-blocks-override", str(args.num_gpu_blocks_override)]
    quant = ["--quantization", args.quantization] if args.quantization != "auto" else []
    preemption = ["--preemption-mode", args.preemption_mode] if args.preemption_mode else []
    if getattr(args, "tenant_kv_share", None) is not None:
        preemption += ["--tenant-kv-share", str(args.tenant_kv_share)]
    if getattr(args, "tenant_fairness", None):
        preemption += ["--tenant-fairness", args.tenant_fairness]
    preemption += ["--admission-order", args.admission_order] if args.admission_order != "auto" else []
    if getattr(args, "worker_timeout", None) is not None:
        preemption += ["--worker-timeout", str(args.worker_timeout)]
    # Like the flags above, only what differs from the worker's defaults (last, normalised).
    pooling = [*(["--pooling-type", args.pooling_type] if args.pooling_type != "last" else []),
               *([] if args.normalize_embeddings else ["--no-normalize-embeddings"])]
    lora = ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank),
            *(["--max-cpu-loras", str(args.max_cpu_loras)] if args.max_cpu_loras else [])
            ] if args.enable_lora or args.lora_modules else []
    return [
        Child(f"worker{suffix}", ["worker_svc", *model, "--port", str(worker_port),
                                  "--tensor-parallel-size", str(args.tensor_parallel_size),
                                  *distributed_flags(args), "--device", args.device, "--dtype", args.dtype,
                                  "--kv-cache-dtype", args.kv_cache_dtype, *quant, *swap, *invariant, *pooling, *lora,
                                  *spec], worker,  # the worker loads a draft model ("model" key)
              needs_serving=False),
        Child(f"scheduler{suffix}", ["scheduler_svc", "--workers", worker, "--port", str(scheduler_port),
                                     *drain, *spec, *preemption], scheduler, needs_serving=True),
    ]


def taken_ports(args: argparse.Namespace) -> list[str]:
    """The launcher's ports that something already listens on, as 'flag PORT' lines. Checked before
    any child starts: otherwise the readiness probes would find the *other* stack's servers and
    report this one as serving while its children die on 'address in use'."""
    if args.node_rank > 0:  # another node's ranks listen on nothing of the launcher's
        return []
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


def print_addresses(args: argparse.Namespace, children: list[Child]) -> None:
    if args.node_rank > 0:
        print(f"Pagoda node {args.node_rank} of {args.nnodes}: its ranks meet rank 0 at "
              f"{args.master_addr}:{args.master_port}.\nCtrl-C stops them.", flush=True)
        return
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
