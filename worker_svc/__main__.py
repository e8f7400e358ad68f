"""`python -m worker_svc --model DIR --port 50061`: one worker process (vLLM's flag names)."""

from __future__ import annotations

import argparse
import json

from pagoda.runtime import event_loop
from pagoda.runtime.logging import get_logger
from pagoda.runtime.service_flags import add_service_flags, configure_service_logging
from worker_svc.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, WorkerConfig

log = get_logger("worker_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker_svc", description=__doc__)
    p.add_argument("--model", help="local HF-format model directory or .gguf file (required unless --fake)")
    p.add_argument("--fake", action="store_true",
                   help="no model: deterministic fake tokens, answers at once (tests, benchmarks)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="the KV cache's byte budget on any device (default: 1 GiB on CPU, --gpu-memory-utilization on CUDA)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; fp8 (e4m3) / fp8_e5m2: one byte per value, 2x the "
                        "blocks of bf16 in the same memory (CPU backends; see kernels/kv_cache_dtype.py)")
    p.add_argument("--swap-space", type=float, default=0.0, metavar="GiB",
                   help="host memory (per rank) for KV blocks swapped out at preemption, pinned on CUDA; "
                        "the scheduler's --preemption-mode uses it (default 0: preemption recomputes). "
                        "--fake: 1024 host blocks per GiB")
    p.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GiB",
                   help="host memory (summed over TP ranks, as vLLM's) for the prefix cache's host tier: "
                        "cached blocks evicted from the device pool are copied there and copied back on "
                        "a later prefix hit instead of recomputed (default 0: dropped). --fake: 1024 "
                        "host blocks per GiB")
    p.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="the prefix cache's disk tier: blocks the host tier (--kv-offloading-size) drops are "
                        "written to files here, loaded back on a later prefix hit, and kept across restarts "
                        "(default: none). --fake: kept in memory")
    p.add_argument("--kv-offload-dir-size", type=float, default=8.0, metavar="GiB",
                   help="the disk tier's size cap; the least recently used files go first (default 8)")
    p.add_argument("--kv-migrate-dir", default=None, metavar="DIR",
                   help="live migration: where migrated requests' KV blocks go between replicas; give every "
                        "replica's worker the same folder (one host or a shared volume). Default: none "
                        "(a migrated request recomputes on its target)")
    p.add_argument("--kv-transfer", default="dir", choices=("dir", "grpc"),
                   help="how live migration's KV goes between replicas' workers: dir (files in the shared "
                        "--kv-migrate-dir) or grpc (worker to worker over this worker's gRPC port, no "
                        "shared folder: the replicas may be on different hosts; docs/reliability.md#live-migration)")
    p.add_argument("--kv-transfer-address", default=None, metavar="HOST:PORT",
                   help="--kv-transfer grpc: the address other workers fetch this one's exports at "
                        "(default: --host:--port; set it when binding 0.0.0.0 or behind NAT)")
    p.add_argument("--kv-transfer-buffer-size", type=float, default=4.0, metavar="GiB",
                   help="--kv-transfer grpc: host memory for exports waiting to be fetched (and as much "
                        "for fetched imports waiting to load); an export that does not fit recomputes")
    p.add_argument("--kv-transfer-ttl", type=float, default=300.0, metavar="SECONDS",
                   help="--kv-transfer grpc: an export (or fetched import) unused this long is dropped")
    p.add_argument("--kv-transfer-tls-ca", default=None, metavar="PEM",
                   help="--kv-transfer grpc: CA that verifies the other workers' ports (when they use TLS)")
    p.add_argument("--kv-snapshot-dir", default=None, metavar="DIR",
                   help="session save / restore (POST /v1/sessions/{id}/save|restore): where session "
                        "snapshots are written and read; give the replicas that may restore a session the "
                        "same folder. Default: none (save and restore answer 400)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "cupy"])
    p.add_argument("--pack-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU: pre-pack linear weights for oneDNN at load (faster GEMMs; see "
                        "worker_svc/models/packed_linear.py)")
    p.add_argument("--warmup-row-buckets", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU, packed weights: build every row bucket's oneDNN primitive at start, so RSS "
                        "stays flat under load (worker_svc/models/row_buckets.py)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="CPU bf16: every token's result independent of the batch shape (greedy outputs "
                        "equal with and without speculation; slower GEMMs: "
                        "worker_svc/models/batch_invariant_linear.py)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="CPU, weight-only (docs/quantization.md): auto serves a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/"
                        "Q4_K/Q5_K/Q6_K linears as stored (an HF directory in float); int8 (g32 "
                        "symmetric) / int4 (g32 affine) quantize an HF directory at load; none "
                        "dequantises a GGUF")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='the scheduler\'s flag, given here too for draft-model speculation: its "model" '
                        '(a directory, a GGUF, or "self:q4") is loaded beside the target '
                        '(docs/speculative_decoding.md); other methods need nothing on the worker')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pooling-type", default="last", choices=("last", "mean"),
                   help="embeddings (/v1/embeddings): the last prompt position's final hidden state, "
                        "or the mean of every position's (worker_svc/pooling.py)")
    p.add_argument("--encoder-cache-size", type=int, default=64,
                   help="vision-language models: images whose encoder output stays cached (LRU, by "
                        "content hash), docs/vision.md")
    p.add_argument("--normalize-embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="L2-normalise embeddings (--no-normalize-embeddings: the raw pooled vector)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT directories) next to the base model (docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=1,
                   help="adapters in device slots at once: distinct adapters among running requests")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank accepted (every slot is padded to it)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="loaded adapters kept in host memory, LRU (default: --max-loras)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    add_distributed_flags(p)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="sizes the memory profile; the scheduler's Init may lower it")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--fake only: the vocabulary it reports and samples from (default: the "
                        "--model directory's, else 2048)")
    add_service_flags(p, serves="Worker", drains=False)
    return p.parse_args(argv)


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's pipeline-parallel and multi-node flags, torchrun's names for the nodes."""
    p.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="split the layers into N stages, one rank (x TP) each (worker_svc/parallel/pipeline.py)")
    p.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                   help="mp: ranks are processes each node's launch starts; ray: rank 0 places the "
                        "others as actors on the Ray cluster (ray start; docs/multi_node.md)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts one instance spans (mp backend)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's index; above 0, it runs only its ranks (no server)")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address: rank 0's rendezvous")
    p.add_argument("--master-port", type=int, default=None,
                   help="rank 0's rendezvous port (needed with --nnodes > 1)")


def advertised_address(host: str, port: int) -> str:
    """Where other workers reach this one: the bind host, or this host's name for a wildcard bind."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        import socket

        host = socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def speculative_model(value: str | None) -> str | None:
    """The draft model of --speculative-config's JSON, or None (no draft model: ngram, suffix)."""
    if not value:
        return None
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as error:
        raise SystemExit(f"bad --speculative-config: {error}") from error
    model = spec.get("model") if isinstance(spec, dict) else None
    return str(model) if model else None


def build_config(args: argparse.Namespace) -> WorkerConfig:
    if args.kv_transfer == "grpc" and args.kv_migrate_dir:
        raise SystemExit("--kv-migrate-dir is the folder of --kv-transfer dir; --kv-transfer grpc needs none")
    return WorkerConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, pack_weights=args.pack_weights,
        pipeline_parallel_size=args.pipeline_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port,
        distributed_executor_backend=args.distributed_executor_backend,
        warmup_row_buckets=args.warmup_row_buckets,
        batch_invariant=args.batch_invariant,
        quantization=args.quantization, speculative_model=speculative_model(args.speculative_config),
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, swap_space=args.swap_space, pooling_type=args.pooling_type,
        encoder_cache_size=args.encoder_cache_size,
        kv_offloading_size=args.kv_offloading_size, kv_offload_dir=args.kv_offload_dir,
        kv_offload_dir_size=args.kv_offload_dir_size, kv_migrate_dir=args.kv_migrate_dir,
        kv_snapshot_dir=args.kv_snapshot_dir, kv_transfer=args.kv_transfer,
        kv_transfer_address=args.kv_transfer_address or advertised_address(args.host, args.port),
        kv_transfer_buffer_size=args.kv_transfer_buffer_size, kv_transfer_ttl_s=args.kv_transfer_ttl,
        kv_transfer_tls_ca=args.kv_transfer_tls_ca,
        normalize_embeddings=args.normalize_embeddings)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_service_logging(args, "worker")
    from pagoda.runtime.telemetry import setup_tracing, shutdown_tracing

    setup_tracing("pagoda-worker", args.otlp_traces_endpoint)
    from worker_svc import fault_injection
    from worker_svc.server import serve

    if fault_injection.fail_request_ids:
        log.warning("test_fault_injection_enabled", env=fault_injection.ENV_VAR,
                    request_ids=sorted(fault_injection.fail_request_ids))

    if args.node_rank > 0:  # no server here: this node's ranks join rank 0's world (worker_svc/parallel/multinode.py)
        from worker_svc.parallel.multinode import serve_node

        serve_node(build_config(args))
        return
    try:
        event_loop.run(serve(lambda: build_runner(args), args.host, args.port, tls_cert=args.tls_cert,
                             tls_key=args.tls_key))
    finally:
        shutdown_tracing()  # flush the last steps' spans


def build_runner(args: argparse.Namespace):
    if args.fake:
        from worker_svc.fake.runner import FAKE_BLOCKS_PER_GIB, FakeStepRunner, fake_vocab_size

        return FakeStepRunner(num_blocks=args.num_gpu_blocks_override or 4096,
                              block_size=args.block_size, max_model_len=args.max_model_len or 4096,
                              vocab_size=args.vocab_size or fake_vocab_size(args.model), check_kv=False,
                              num_cpu_blocks=int(args.swap_space * FAKE_BLOCKS_PER_GIB),
                              num_offload_blocks=int(args.kv_offloading_size * FAKE_BLOCKS_PER_GIB),
                              num_disk_blocks=int(args.kv_offload_dir_size * FAKE_BLOCKS_PER_GIB)
                              if args.kv_offload_dir else 0)
    if not args.model:
        raise SystemExit("--model is required (or --fake)")
    from worker_svc.parallel.tp_worker import create_runner  # torch import: after flags parse

    # TP > 1: this process is rank 0 and spawns the other ranks; a rank dying exits this process.
    runner = create_runner(build_config(args), max_num_batched_tokens=args.max_num_batched_tokens,
                           exit_on_failure=True)
    log.info("model_loaded", model=args.model, device=str(runner.device),
             tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size)
    return runner


if __name__ == "__main__":
    main()
