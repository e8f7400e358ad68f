"""Attention kernels behind one Python signature each, with selectable backends.

Cache layout (every backend): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].

    write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None
        key, value:   [num_tokens, num_kv_heads, head_dim]
        slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; -1 is skipped

    paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len, max_seq_len, sliding_window=None, logits_soft_cap=None)
        -> out [num_tokens, num_heads, head_dim]
        query:           [num_tokens, num_heads, head_dim], sequences packed back to back
        block_tables:    [num_seqs, max_blocks_per_seq] int32 (entries past a table's end: any)
        seq_lens:        [num_seqs] int32, context length *including* this step's query tokens
        query_start_loc: [num_seqs + 1] int32, sequence i owns query rows [qsl[i], qsl[i+1])
        Query row j of sequence i sits at position seq_len - q_len + j and attends to positions
        0..that position (lower-right causal): prefill chunks over their cached prefix and decode
        rows (q_len == 1) in one batch. sliding_window=W (HF's convention) narrows that to positions
        p - W < k <= p; table entries of blocks wholly before every row's window are never read (the
        scheduler may have freed them and left a placeholder id).
        GQA: query head h reads KV head h // (num_heads / num_kv_heads).
        logits_soft_cap=C (Gemma 2's attn_logit_softcapping): each score s = scale * q.k becomes
        C * tanh(s / C) before the softmax; None: scores as they are.

Backends: "torch" (the reference and oracle, any device), "cpu" (a compiled C++/OpenMP kernel that
reads K/V blocks in place; kernels/cpu_extension.py builds it), "cupy" (CUDA RawKernels).
The backend is chosen by configuration (`--attention-backend torch|cpu|cupy`), never by a failed
import: CPU machines never import cupy at module load. "auto" picks "cupy" on CUDA for fp16/bf16
("torch" for fp32, which the CuPy kernels are not compiled for), "cpu" on CPU wherever the
extension can be built (a C++ compiler and ninja: `make setup` builds it); a build that then fails
raises instead of silently serving the slower reference.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

BackendName = Literal["torch", "cpu", "cupy"]


class AttentionBackend(Protocol):
    name: str

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None) -> torch.Tensor: ...


def default_backend_name(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> BackendName:
    if device.type == "cuda":
        # The CuPy kernels are compiled for fp16/bf16 activations; fp32 on a GPU (parity runs,
        # debugging) reads its cache through the torch reference instead.
        return "cupy" if dtype in (torch.float16, torch.bfloat16) else "torch"
    from kernels.cpu_extension import toolchain_available

    return "cpu" if device.type == "cpu" and toolchain_available() else "torch"


def get_backend(name: BackendName) -> AttentionBackend:
    if name == "torch":
        from kernels.paged_attention.reference import TorchBackend

        return TorchBackend()
    if name == "cpu":
        from kernels.paged_attention.cpu_impl import CpuBackend

        return CpuBackend()
    if name == "cupy":
        # Imported only when asked for: cupy needs a CUDA driver at run time.
        from kernels.paged_attention.cupy_impl import CupyBackend

        return CupyBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch', 'cpu' or 'cupy'")
