"""KV-cache dtypes by vLLM's `--kv-cache-dtype` names (worker_svc/config.py): "auto" (the model's
dtype) or FP8.

An FP8 cache holds each K/V element in one byte (2x the blocks of a bf16 cache in the same memory,
4x of fp32). Values are stored as they are, i.e. with vLLM's default per-tensor scale of 1.0
(Pagoda reads no calibrated scales from checkpoints and has no --calculate-kv-scales yet; the CUDA
kernels take k_scale/v_scale arguments), converted as torch's `.to(float8)` does in every backend:
rounded to nearest even, e4m3 saturating at +-448, e5m2 overflowing to inf; the attention kernels
decode on load and accumulate in fp32. e4m3 keeps more precision (3 mantissa bits, max 448),
e5m2 more range (2 bits, max 57344). Attention activations of small models sit far inside both.
"""

from __future__ import annotations

import torch

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name not in _FP8:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose auto, {', '.join(_FP8)}")
    return _FP8[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
