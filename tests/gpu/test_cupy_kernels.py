"""CuPy kernels on a real GPU against an fp64 CPU reference (kernels.md §5). Skipped without CUDA.

Run: .venv/bin/python -m pytest -q tests/gpu   (benchmarks/paged_attention.py --check runs it too)
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.paged_attention.cupy_impl import CupyBackend, KernelShape
from kernels.paged_attention.reference import TorchBackend

DEVICE = "cuda"
NUM_KV_HEADS = 2
# dtype -> (max ||out-ref|| / ||ref||, assert_close atol = rtol)
TOLERANCE = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def build_case(seq_lens, q_lens, group, head_dim, block_size, dtype, seed=0, logit_scale=1.0,
               strided_query=False):
    """Paged cache poisoned with NaN, random block tables (pool 3x the need, junk ids past each
    table's end, sequence 1 sharing sequence 0's first block when both are long enough)."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(need + [1]) + 2
    pool = 3 * max(sum(need), 1)
    shape = (pool, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.full((len(seq_lens), max_blocks), 2**30, dtype=torch.int32)
    perm, used = torch.randperm(pool, generator=gen), 0
    for i in range(len(seq_lens)):
        tables[i, : need[i]] = perm[used : used + need[i]].int()
        used += need[i]
    if len(seq_lens) > 1 and min(seq_lens[:2]) >= block_size:
        tables[1, 0] = tables[0, 0]  # a shared full prefix block (prefix caching)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n)
        blocks, offs = tables[i, (pos // block_size)].long(), pos % block_size
        k_cache[blocks, offs] = (torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen) * logit_scale).to(dtype)
        v_cache[blocks, offs] = torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    num_tokens, num_heads = sum(q_lens), NUM_KV_HEADS * group
    if strided_query:  # a slice of a fused qkv projection
        qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, generator=gen).to(dtype)
        query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    else:
        query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


def reference_fp64(query, k_cache, v_cache, tables, seq_lens, qsl, scale):
    """Lower-right causal paged attention in fp64 on CPU from the same rounded inputs."""
    block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i].item(), qsl[i + 1].item()
        if end == start:
            continue
        blocks = tables[i, : math.ceil(seq_len / block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)  # [L, Hq, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        q = query[start:end].double()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


def run(backend, case, scale):
    query, k_cache, v_cache, tables, seq_lens, qsl = (t.to(DEVICE) for t in case)
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    poison = torch.full((1 << 22,), float("nan"), device=DEVICE)  # freed memory the output may reuse
    del poison
    out = backend.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale,
                                  max(q_lens), int(seq_lens.max()))
    torch.cuda.synchronize()
    return out.cpu()


def assert_accurate(out, case, scale):
    ref = reference_fp64(*case, scale)
    dtype = out.dtype
    rel_limit, tol = TOLERANCE[dtype]
    assert not torch.isnan(out).any()
    assert (out.double() - ref).norm() <= rel_limit * ref.norm() + 1e-12
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    return ref


def assert_within_twice_torch_error(out, case, scale, ref):
    """FlashAttention's rule: no worse than twice the torch low-precision path."""
    query, k_cache, v_cache, tables, seq_lens, qsl = case
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    torch_out = TorchBackend().paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale,
                                               max(q_lens), int(seq_lens.max()))
    torch_err = (torch_out.double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * torch_err + 1e-6


SHAPES = [(dtype, d, bs, g) for dtype in (torch.bfloat16, torch.float16) for d in (64, 128, 256)
          for bs in (16, 32) for g in (1, 2, 4, 8)]
# The odd GQA ratios (SmolLM2's 3, Qwen's 5-7) on the common shapes.
SHAPES += [(torch.bfloat16, d, 16, g) for d in (64, 128) for g in (3, 5, 6, 7)]


@pytest.mark.parametrize("dtype,head_dim,block_size,group", SHAPES)
def test_decode_matches_fp64(dtype, head_dim, block_size, group):
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 511, 512, 513, 77]
    case = build_case(seq_lens, [1] * len(seq_lens), group, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = run(CupyBackend(), case, scale)
    ref = assert_accurate(out, case, scale)
    assert_within_twice_torch_error(out, case, scale, ref)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forced_splits_match_unsplit_within_one_ulp(num_splits, dtype):
    # 16 splits over ~513 tokens: short sequences get whole empty splits.
    case = build_case([513, 3, 0, 200], [1, 1, 1, 1], 4, 128, 16, dtype, seed=1)
    split = run(CupyBackend(num_splits=num_splits), case, 0.088)
    unsplit = run(CupyBackend(num_splits=1), case, 0.088)
    assert_accurate(split, case, 0.088)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(split.float(), unsplit.float(), rtol=eps, atol=eps * unsplit.abs().max().item())
    assert torch.equal(split[2], torch.zeros_like(split[2]))  # seq_len 0 padding row


def test_long_context_large_logits_strided_query():
    case = build_case([8209, 1, 4000], [1, 1, 1], 8, 128, 16, torch.bfloat16, seed=2, logit_scale=8.0,
                      strided_query=True)
    out = run(CupyBackend(), case, 128**-0.5)
    assert_accurate(out, case, 128**-0.5)


def test_mixed_batch_prefill_chunk_prefix_and_decode():
    # decode, chunk of 7 over a 40-token prefix, fresh 33-token prompt, decode.
    case = build_case([300, 47, 33, 18], [1, 7, 33, 1], 4, 128, 16, torch.bfloat16, seed=3)
    out = run(CupyBackend(), case, 0.1)
    assert_accurate(out, case, 0.1)


def test_repeat_runs_are_bitwise_equal():
    case = build_case([513, 40], [1, 1], 2, 64, 32, torch.float16, seed=4)
    backend = CupyBackend(num_splits=3)
    assert torch.equal(run(backend, case, 0.125), run(backend, case, 0.125))


def test_unsupported_group_size_is_refused():
    with pytest.raises(ValueError, match="GQA group size 32"):
        KernelShape(torch.bfloat16, 128, 16, 32).validate()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cache_write_bitwise_equals_index_copy(dtype):
    gen = torch.Generator().manual_seed(5)
    num_tokens, head_dim, block_size = 37, 128, 16
    qkv = torch.randn(num_tokens, (4 + 2 * NUM_KV_HEADS) * head_dim, generator=gen).to(dtype)
    key = qkv[:, 4 * head_dim : (4 + NUM_KV_HEADS) * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    value = qkv[:, (4 + NUM_KV_HEADS) * head_dim :].view(num_tokens, NUM_KV_HEADS, head_dim)
    slots = torch.randperm(20 * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    k_cache = torch.randn(20, block_size, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(20, block_size, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    TorchBackend().write_kv_cache(key, value, expected_k, expected_v, slots)
    gpu = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slots)]
    CupyBackend().write_kv_cache(*gpu)
    assert torch.equal(gpu[2].cpu().view(torch.int16), expected_k.view(torch.int16))
    assert torch.equal(gpu[3].cpu().view(torch.int16), expected_v.view(torch.int16))


@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
@pytest.mark.parametrize("window", [1, 16, 37, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sliding_window_decode_and_prefill(num_splits, window, dtype):
    # Decode rows past, at and below the window, and a prefill chunk (the torch path inside the
    # backend); table entries of blocks wholly before each row's window are out-of-range ids (the
    # scheduler freed them): the kernel must never read them. Reference: the torch backend's window.
    seq_lens, q_lens = [513, 40, 37, 5, 200], [1, 1, 1, 1, 9]
    case = build_case(seq_lens, q_lens, 4, 128, 16, dtype, seed=window)
    query, k_cache, v_cache, tables, lens, qsl = case
    for i, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        first_seen = max(0, n - q - window + 1)
        tables[i, : first_seen // 16] = 2**30
    ref = TorchBackend().paged_attention(query, k_cache, v_cache, tables, lens, qsl, 0.088, max(q_lens),
                                         max(seq_lens), sliding_window=window)
    args = [t.to(DEVICE) for t in (query, k_cache, v_cache, tables, lens, qsl)]
    out = CupyBackend(num_splits=num_splits).paged_attention(*args, 0.088, max(q_lens), max(seq_lens),
                                                             sliding_window=window)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    _, tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_soft_capped_decode_and_prefill(num_splits, window, dtype):
    # Gemma 2's attn_logit_softcapping: scores widened (logit_scale) so that a cap of 2 bends most
    # of them. Reference: the torch backend's cap (itself checked against fp64 in
    # tests/unit/test_attention_window.py).
    seq_lens, q_lens = [513, 40, 37, 5, 200], [1, 1, 1, 1, 9]
    query, k_cache, v_cache, tables, lens, qsl = build_case(seq_lens, q_lens, 4, 128, 16, dtype, seed=3,
                                                            logit_scale=4.0)
    ref = TorchBackend().paged_attention(query, k_cache, v_cache, tables, lens, qsl, 0.088, max(q_lens),
                                         max(seq_lens), sliding_window=window, logits_soft_cap=2.0)
    args = [t.to(DEVICE) for t in (query, k_cache, v_cache, tables, lens, qsl)]
    out = CupyBackend(num_splits=num_splits).paged_attention(*args, 0.088, max(q_lens), max(seq_lens),
                                                             sliding_window=window, logits_soft_cap=2.0)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    _, tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
