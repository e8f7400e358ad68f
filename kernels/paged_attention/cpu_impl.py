"""Compiled CPU backend: paged attention that reads K/V blocks in place (kernels/paged_attention/
cpu_attention.cpp, built by kernels/cpu_extension.py).

Same signatures and cache layout as kernels/__init__.py. Unlike the torch reference it needs no
per-step plan: the op walks each sequence's block table directly, so there is no gather, no
padding to a bucket's longest context and nothing to cache between layers.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import load
from kernels.kv_cache_dtype import is_fp8


class CpuBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._ops = load()

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # key, value: [T, Hkv, D]; slot_mapping: [T] int64, -1 = padding (skipped)
        if key.dtype != k_cache.dtype:  # the reference converts too (fp32 activations, bf16 cache)
            key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
        self._ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None) -> torch.Tensor:
        # query: [T, Hq, D] -> out: [T, Hq, D] (max_query_len / max_seq_len: the op needs neither)
        if not is_fp8(k_cache.dtype):  # an FP8 cache is decoded inside the op; the query stays as is
            query = query.to(k_cache.dtype)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        out = self._ops.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                        sliding_window or 0, logits_soft_cap or 0.0)  # the op's 0s: none
        return out.to(query.dtype)  # no-ops when query and cache share a dtype (always, in the worker)
