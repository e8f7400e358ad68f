"""KV-cache write through the RawKernel in kv_cache_write.cu (CUDA only; no cupy import here).

`check_write_args` is pure torch (unit-testable on CPU); `launch_kv_cache_write` takes an already
compiled kernel and a CuPy stream from the backend. An FP8 cache is encoded on the way in (the
kernel's bytes are torch's `.to(float8)` of value / scale).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.kv_cache_dtype import is_fp8

VEC_BYTES = 16  # every copy is one uint4
MAX_THREADS = 512


def _aligned(tensor: torch.Tensor) -> bool:
    elems_per_vec = VEC_BYTES // tensor.element_size()
    strides_ok = all(s % elems_per_vec == 0 for s in tensor.stride()[:-1])
    return tensor.stride(-1) == 1 and strides_ok and tensor.data_ptr() % VEC_BYTES == 0


def check_write_args(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Raise ValueError for inputs the 16-byte-vector kernel cannot serve."""
    if key.dtype != value.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError("key and value must share one dtype, and so must both caches")
    if k_cache.dtype != key.dtype and not (is_fp8(k_cache.dtype) and key.element_size() == 2):
        raise ValueError(f"a {k_cache.dtype} cache takes {k_cache.dtype} rows, or fp16/bf16 rows when it "
                         f"is FP8; got {key.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if key.shape[1:] != k_cache.shape[2:] or value.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key/value rows {tuple(key.shape[1:])} do not match cache {tuple(k_cache.shape[2:])}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous int64 tensor")
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError("slot_mapping is longer than key")
    for name, tensor in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not _aligned(tensor):
            raise ValueError(f"{name} rows must be contiguous and 16-byte aligned")


def launch_kv_cache_write(kernel, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, stream,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key, value [T, Hkv, D] -> cache slots; T = len(slot_mapping) (CUDA-graph padding in key ignored).

    k_scale / v_scale: FP8 per-tensor scales (the cache holds value / scale); ignored otherwise.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    vecs = num_kv_heads * head_dim * key.element_size() // VEC_BYTES  # one 16-byte load of key each
    args = (
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        np.int32(num_kv_heads), np.int32(head_dim), np.int32(block_size),
        np.int64(key.stride(0)), np.int64(key.stride(1)),
        np.int64(value.stride(0)), np.int64(value.stride(1)),
        np.int64(k_cache.stride(0)), np.int64(k_cache.stride(1)), np.int64(k_cache.stride(2)),
        np.float32(1.0 / k_scale), np.float32(1.0 / v_scale),
    )
    kernel((num_tokens,), (min(vecs, MAX_THREADS),), args, stream=stream)
