"""The CuPy backend's FP8 plumbing, on the CPU: which kernel each dtype pair gets, what the launch
passes, what is refused. (No cupy import: the kernels are stood in for; tests/gpu runs them.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.cache_write import check_write_args, launch_kv_cache_write
from kernels.paged_attention.cupy_impl import CupyBackend, KernelShape

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _RecordingModules:
    """ModuleCache stand-in: records the keys compiled and returns the names as kernels."""

    def __init__(self) -> None:
        self.keys: list[object] = []

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def kernels(self, key, source_path, names):
        if key not in self.keys:
            self.keys.append(key)
        return {name: name for name in names}


@pytest.fixture
def backend() -> CupyBackend:
    backend = CupyBackend()
    backend._modules = _RecordingModules()
    return backend


def test_each_cache_dtype_gets_its_own_instantiation(backend):
    names = {cache: backend._decode_kernels(KernelShape(torch.bfloat16, 128, 16, 4, cache))[0]
             for cache in (None, torch.bfloat16, E4M3, E5M2)}
    assert names[None] == names[torch.bfloat16] == "pagoda::paged_decode<__nv_bfloat16, __nv_bfloat16, 128, 16, 4, 128>"
    assert names[E4M3] == "pagoda::paged_decode<__nv_bfloat16, pagoda::fp8_e4m3, 128, 16, 4, 128>"
    assert names[E5M2] == "pagoda::paged_decode<__nv_bfloat16, pagoda::fp8_e5m2, 128, 16, 4, 128>"
    assert backend._cache_write_kernel(torch.float16, E5M2) == "pagoda::kv_cache_write<__half, pagoda::fp8_e5m2>"


def test_warmup_and_run_time_share_one_module(backend):
    # warm-up names no cache dtype; a step passes the cache's: one compile, not a second mid-capture
    backend.warmup([KernelShape(torch.float16, 64, 32, 2)])
    backend._decode_kernels(KernelShape(torch.float16, 64, 32, 2, torch.float16))
    backend._cache_write_kernel(torch.float16, torch.float16)
    assert len(backend._modules.keys) == 2  # one decode module, one cache write
    backend.warmup([KernelShape(torch.float16, 64, 32, 2, E4M3)])
    backend._decode_kernels(KernelShape(torch.float16, 64, 32, 2, E4M3))
    assert len(backend._modules.keys) == 4


def test_unsupported_cache_dtypes_are_refused():
    KernelShape(torch.bfloat16, 128, 16, 4, E4M3).validate()
    with pytest.raises(ValueError, match="float16 cache under torch.bfloat16"):
        KernelShape(torch.bfloat16, 128, 16, 4, torch.float16).validate()
    with pytest.raises(ValueError, match="float16/bfloat16, not torch.float32"):
        KernelShape(torch.float32, 128, 16, 4, E4M3).validate()
    with pytest.raises(ValueError, match="positive"):
        CupyBackend(k_scale=0.0)


def _write_args(key_dtype, cache_dtype, v_cache_dtype=None):
    key = torch.zeros(5, 2, 64, dtype=key_dtype)
    k_cache = torch.zeros(4, 16, 2, 64, dtype=cache_dtype)
    v_cache = torch.zeros(4, 16, 2, 64, dtype=v_cache_dtype or cache_dtype)
    return key, key.clone(), k_cache, v_cache, torch.tensor([0, 3, -1, 17, 40])


def test_write_checks_take_half_rows_into_fp8_and_nothing_else():
    check_write_args(*_write_args(torch.bfloat16, E4M3))
    check_write_args(*_write_args(torch.float16, E5M2))
    with pytest.raises(ValueError, match="fp16/bf16 rows when it is FP8"):
        check_write_args(*_write_args(torch.float32, E4M3))
    with pytest.raises(ValueError, match="share one dtype"):
        check_write_args(*_write_args(torch.bfloat16, E4M3, E5M2))
    with pytest.raises(ValueError, match="fp16/bf16 rows when it is FP8"):
        check_write_args(*_write_args(torch.bfloat16, torch.float16))


def test_fp8_write_launch_covers_each_row_once_and_passes_inverse_scales():
    calls = []
    key, value, k_cache, v_cache, slots = _write_args(torch.bfloat16, E4M3)
    launch_kv_cache_write(lambda grid, block, args, stream: calls.append((grid, block, args)),
                          key, value, k_cache, v_cache, slots, stream=None, k_scale=0.5, v_scale=4.0)
    (grid, block, args), = calls
    # 2 heads x 64 dims of bf16 = 16 sixteen-byte loads per token (not 8: the cache's 1-byte size)
    assert grid == (5,) and block == (16,)
    assert args[-2:] == (np.float32(2.0), np.float32(0.25))
    assert args[-5:-2] == (np.int64(16 * 2 * 64), np.int64(2 * 64), np.int64(64))  # cache strides, elements
