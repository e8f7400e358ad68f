"""The worker's one frozen config (built from flags in `__main__`, or by the offline LLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)  # the --dtype choices of the worker and the launcher
# vLLM's --kv-cache-dtype names (kernels/kv_cache_dtype.py maps them to torch dtypes)
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDType)
# vLLM's --quantization (weight-only, CPU; docs/quantization.md): auto serves a GGUF's quantized
# linears as stored and an HF directory in float; int8 / int4 quantize an HF directory at load;
# none dequantises a GGUF (the pre-quantization behaviour, for exact HF parity)
Quantization = Literal["auto", "none", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str  # a local HF-format directory or .gguf file
    dtype: DType = "auto"  # auto follows config.json
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the worker may use
    num_gpu_blocks_override: int | None = None  # exact block count (tests, CPU)
    kv_cache_memory_bytes: int | None = None  # byte budget for the cache, any device (CPU default 1 GiB)
    kv_cache_dtype: KVCacheDType = "auto"  # vLLM's names: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2
    attention_backend: Literal["auto", "torch", "cpu", "cupy"] = "auto"  # auto: cupy on CUDA, cpu on CPU
    seed: int = 0
    tensor_parallel_size: int = 1
    # vLLM's --pipeline-parallel-size: the layers split into this many stages (worker_svc/parallel/pipeline.py)
    pipeline_parallel_size: int = 1
    # Several hosts (torchrun's contract, one worker launch per host; worker_svc/parallel/multinode.py):
    # nnodes hosts, this one's node_rank, rank 0's rendezvous at master_addr:master_port.
    # The ranks split evenly over the nodes, consecutively: TP inside a node, PP across nodes.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None with one node: a free port
    # "mp": this host's ranks are processes it starts; "ray": rank 0 places the other ranks as Ray
    # actors on the cluster's nodes (worker_svc/parallel/ray_ranks.py)
    distributed_executor_backend: str = "mp"
    pack_weights: bool = True  # CPU: linear weights pre-packed for oneDNN (models/packed_linear.py)
    # With packed weights: build the oneDNN primitive of every row bucket at the first Init
    # (models/row_buckets.py `warm_row_buckets`), so the worker's RSS does not step up under load.
    warmup_row_buckets: bool = True
    # CPU bf16: linears whose rows do not depend on the batch shape (models/batch_invariant_linear.py),
    # so greedy outputs are the same with speculation on or off, alone or in a batch. vLLM's
    # VLLM_BATCH_INVARIANT.
    batch_invariant: bool = False
    quantization: Quantization = "auto"  # weight-only int8 / int4 linears (models/quant_linear.py)
    # Draft-model speculation (worker_svc/draft_model.py): the "model" of --speculative-config, a
    # directory, a GGUF, or "self:q4" (the target quantized to int4 at load). None: no draft model.
    speculative_model: str | None = None
    # Multi-LoRA (worker_svc/lora/): vLLM's --enable-lora --max-loras --max-lora-rank --max-cpu-loras
    enable_lora: bool = False
    max_loras: int = 1  # adapters in device slots at once (distinct adapters per step)
    max_lora_rank: int = 16  # every slot is padded to this rank; a higher-rank adapter is refused
    max_cpu_loras: int | None = None  # loaded adapters kept on the host (LRU); None: max_loras
    # vLLM's --swap-space: GiB of host memory (per rank) for KV blocks swapped out at preemption
    # (pinned on CUDA). 0 (the default, as vLLM v1 which only recomputes): none.
    swap_space: float = 0.0
    # vLLM's --kv-offloading-size: GiB of host memory, summed over TP ranks as vLLM's, for the prefix
    # cache's host tier (scheduler_svc/core/tiers/host_tier.py): the same host pool as the swap space,
    # the blocks after its. 0 (the default): cached blocks evicted from the device are dropped.
    kv_offloading_size: float = 0.0
    # The prefix cache's disk tier (worker_svc/disk_tier/, scheduler_svc/core/tiers/disk_tier.py):
    # the host tier's dropped blocks go to files in this directory, capped at kv_offload_dir_size
    # GiB (LRU by file); they survive a restart. None (the default): dropped. Needs the host tier.
    kv_offload_dir: str | None = None
    kv_offload_dir_size: float = 8.0
    # Live migration (worker_svc/disk_tier/migration.py): the folder, shared by the replicas' workers,
    # where a migrated request's KV blocks go from the source to the target. None: no migration
    # of KV (a migrated request recomputes on its target).
    kv_migrate_dir: str | None = None
    # Live migration without a shared folder (worker_svc/kv_transfer/): "grpc" keeps exports in host
    # memory (kv_transfer_buffer_size GiB, each for 'kv_transfer_ttl_s' seconds; as much again for
    # pulled imports) served on this worker's port at kv_transfer_address, and pulls imports from
    # the source worker named in the handoff. "dir": the shared folder above.
    kv_transfer: Literal["dir", "grpc"] = "dir"
    kv_transfer_address: str = ""  # host:port other workers reach this one at (--kv-transfer-address)
    kv_transfer_buffer_size: float = 4.0
    kv_transfer_ttl_s: float = 300.0
    kv_transfer_tls_ca: str | None = None  # PEM CA of the other workers' ports, when they use TLS
    # Session save / restore (worker_svc/disk_tier/snapshots.py): the folder of session snapshots,
    # shared by the replicas that may restore them (llama.cpp's --slot-save-path). None: no save.
    kv_snapshot_dir: str | None = None
    # Embeddings (worker_svc/pooling.py): vLLM's --pooling-type (last | mean) and normalisation
    pooling_type: str = "last"
    # Vision-language models (worker_svc/multimodal.py): images whose embeddings stay cached, by hash
    encoder_cache_size: int = 64
    normalize_embeddings: bool = True
