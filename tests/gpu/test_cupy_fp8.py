"""CuPy kernels over FP8 KV caches (--kv-cache-dtype fp8 / fp8_e5m2) on a real GPU. Skipped without CUDA.

Written without a GPU to run them on (the task that built the FP8 CUDA path had none): CI compiles
every variant (tests/unit/test_kernel_compile.py) and checks the encode/decode arithmetic on the
host (tests/unit/test_fp8_codec.py); these are the checks only a GPU can make.
The decode is exact, so the kernel's output is held to the same fp64 reference, from the same
FP8-rounded cache, and the same tolerances as the fp16/bf16 caches; the cache write must produce
the bytes torch's `.to(float8)` produces.
Run: .venv/bin/python -m pytest -q tests/gpu
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention.cupy_impl import CupyBackend
from kernels.paged_attention.reference import TorchBackend
from tests.gpu.test_cupy_kernels import DEVICE, NUM_KV_HEADS, assert_accurate, build_case, reference_fp64, run

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(dtype, cache, d, bs, g) for dtype in (torch.bfloat16, torch.float16) for cache in FP8
          for d in (64, 128, 256) for bs in (16, 32) for g in (1, 2, 4, 8)]


def fp8_case(seq_lens, q_lens, group, head_dim, block_size, dtype, cache_dtype, seed=0, **kwargs):
    """build_case's paged cache (NaN-poisoned slots stay NaN codes), stored as FP8."""
    query, k_cache, v_cache, tables, lens, qsl = build_case(seq_lens, q_lens, group, head_dim, block_size,
                                                            dtype, seed=seed, **kwargs)
    return query, k_cache.to(cache_dtype), v_cache.to(cache_dtype), tables, lens, qsl


@pytest.mark.parametrize("dtype,cache_dtype,head_dim,block_size,group", SHAPES)
def test_fp8_decode_matches_fp64_and_the_torch_path(dtype, cache_dtype, head_dim, block_size, group):
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 511, 512, 513, 77]
    case = fp8_case(seq_lens, [1] * len(seq_lens), group, head_dim, block_size, dtype, cache_dtype)
    scale = head_dim**-0.5
    out = run(CupyBackend(), case, scale)
    assert out.dtype == dtype
    assert_accurate(out, case, scale)
    # the torch reference decodes on gather (as tests/unit/test_cpu_attention.py's FP8 test checks)
    query, k_cache, v_cache, tables, lens, qsl = case
    torch_out = TorchBackend().paged_attention(query, k_cache, v_cache, tables, lens, qsl, scale, 1,
                                               int(lens.max()))
    torch.testing.assert_close(out.double(), torch_out.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_forced_splits_match_unsplit_within_one_ulp(num_splits, cache_dtype):
    case = fp8_case([513, 3, 0, 200], [1, 1, 1, 1], 4, 128, 16, torch.bfloat16, cache_dtype, seed=1)
    split = run(CupyBackend(num_splits=num_splits), case, 0.088)
    unsplit = run(CupyBackend(num_splits=1), case, 0.088)
    assert_accurate(split, case, 0.088)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(split.float(), unsplit.float(), rtol=eps, atol=eps * unsplit.abs().max().item())
    assert torch.equal(split[2], torch.zeros_like(split[2]))


def _scaled_reference(case, scale, k_scale, v_scale):
    query, k_cache, v_cache, tables, lens, qsl = case
    return reference_fp64(query, k_cache.double() * k_scale, v_cache.double() * v_scale, tables, lens, qsl, scale)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_per_tensor_scales_decode_and_mixed_batch(cache_dtype):
    # decode rows (the kernel) and prefill rows over a cached prefix (the torch path, scales folded)
    k_scale, v_scale = 0.25, 3.0
    case = fp8_case([300, 47, 33, 18], [1, 7, 33, 1], 4, 128, 16, torch.bfloat16, cache_dtype, seed=3)
    out = run(CupyBackend(k_scale=k_scale, v_scale=v_scale), case, 0.1)
    ref = _scaled_reference(case, 0.1, k_scale, v_scale)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=2e-2 * v_scale, rtol=2e-2)
    # and the scales matter: unscaled decoding is far off
    assert (run(CupyBackend(), case, 0.1).double() - ref).abs().max() > 0.5


def _special_rows(num_tokens, heads, head_dim, dtype, gen):
    """Random rows plus every edge the encoder has: ties, overflow, inf, NaN, subnormals, -0."""
    rows = torch.randn(num_tokens, heads, head_dim, generator=gen) * 4
    special = torch.tensor([448.0, 464.0, 465.0, 480.0, 1e4, 57344.0, 61440.0, 1e5, float("inf"),
                            -float("inf"), float("nan"), -0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-17,
                            1.0625, 1.1875, -300.0, 0.0])
    rows.view(-1)[: special.numel()] = special
    return rows.to(dtype)


def _saturating(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """e4m3fn has no inf: the kernel saturates finite overflow and +-inf to +-448, as torch >= 2.13
    does (the pin). torch 2.11 (seen on the GPU image) turned them into NaN instead; clamping
    first makes the reference the same under both."""
    if cache_dtype != torch.float8_e4m3fn:
        return x
    return torch.where(x.isnan(), x, x.clamp(-448.0, 448.0))


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 4.0)])
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_write_bytes_equal_torch(dtype, cache_dtype, scales):
    k_scale, v_scale = scales
    gen = torch.Generator().manual_seed(5)
    num_tokens, head_dim, block_size = 37, 128, 16
    qkv = torch.cat([_special_rows(num_tokens, 4, head_dim, dtype, gen).flatten(1),
                     _special_rows(num_tokens, 2 * NUM_KV_HEADS, head_dim, dtype, gen).flatten(1)], 1)
    key = qkv[:, 4 * head_dim : (4 + NUM_KV_HEADS) * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    value = qkv[:, (4 + NUM_KV_HEADS) * head_dim :].view(num_tokens, NUM_KV_HEADS, head_dim)
    key[0, 0, :20] = _special_rows(1, 1, 20, dtype, gen).view(-1)  # the edges in K and V
    value[1, 1, :20] = _special_rows(1, 1, 20, dtype, gen).view(-1)
    slots = torch.randperm(20 * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    k_cache = torch.randn(20, block_size, NUM_KV_HEADS, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(20, block_size, NUM_KV_HEADS, head_dim, generator=gen).to(cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    # torch's own conversion of value / scale (exact in fp32: the scales are powers of two)
    TorchBackend().write_kv_cache(_saturating(key.float() / k_scale, cache_dtype),
                                  _saturating(value.float() / v_scale, cache_dtype), expected_k, expected_v, slots)
    gpu = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slots)]
    CupyBackend(k_scale=k_scale, v_scale=v_scale).write_kv_cache(*gpu)
    torch.cuda.synchronize()
    assert torch.equal(gpu[2].cpu().view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(gpu[3].cpu().view(torch.uint8), expected_v.view(torch.uint8))


def test_fp8_long_context_large_logits_strided_query():
    case = fp8_case([8209, 1, 4000], [1, 1, 1], 8, 128, 16, torch.bfloat16, torch.float8_e4m3fn, seed=2,
                    logit_scale=8.0, strided_query=True)
    out = run(CupyBackend(), case, 128**-0.5)
    assert_accurate(out, case, 128**-0.5)
