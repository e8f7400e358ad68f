"""Sliding-window paged attention (HF's convention: the row at position p sees keys p - W < k <= p)
in the torch reference and the compiled CPU kernel, against a dense fp64 reference, with the table
entries of blocks wholly before every row's window set to out-of-range ids (what the scheduler
leaves after freeing them): neither backend may read them. Also Gemma 2's soft-capped scores
(C * tanh(s / C) before the softmax), alone and under a window."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import get_backend
from kernels.cpu_extension import toolchain_available

BLOCK_SIZE = 8
NUM_KV_HEADS = 2
HEAD_DIM = 32
PLACEHOLDER = 10_000  # out of range of every pool below

BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not toolchain_available(), reason="no C++ compiler / ninja: the CPU kernel cannot be built"))]


def dense_reference(query, keys, values, scale, window, soft_cap=None):
    """query [q_len, Hq, D]; keys/values [ctx, Hkv, D] -> [q_len, Hq, D] in fp64."""
    q_len, num_heads, _ = query.shape
    ctx = keys.shape[0]
    group = num_heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale  # [Hq, q_len, ctx]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    position = torch.arange(q_len)[:, None] + (ctx - q_len)  # [q_len, 1]
    key_pos = torch.arange(ctx)[None, :]
    hidden = key_pos > position
    if window is not None:
        hidden |= key_pos <= position - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def make_case(seqs, group, window, seed=0, soft_cap=None, q_mul=1.0):
    """seqs: (seq_len, q_len) each. Returns (paged_attention args, expected). q_mul widens the
    scores (so that a soft cap bites)."""
    gen = torch.Generator().manual_seed(seed)
    writer = get_backend("torch")
    needed = [math.ceil(s / BLOCK_SIZE) for s, _ in seqs]
    pool = 2 * sum(needed) + 3
    shape = (pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    perm = torch.randperm(pool, generator=gen).tolist()
    tables = torch.full((len(seqs), max(needed) + 1), PLACEHOLDER, dtype=torch.int32)
    queries, expected = [], []
    scale = HEAD_DIM**-0.5
    for i, (seq_len, q_len) in enumerate(seqs):
        # Blocks whose last position is before the first row's window are "freed": placeholder ids,
        # nothing written (the row at seq_len - q_len sees positions >= seq_len - q_len - window + 1).
        first_seen = 0 if window is None else max(0, seq_len - q_len - window + 1)
        for b in range(needed[i]):
            if (b + 1) * BLOCK_SIZE > first_seen:
                tables[i, b] = perm.pop()
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        q = q_mul * torch.randn(q_len, NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
        live = [p for p in range(seq_len) if int(tables[i, p // BLOCK_SIZE]) != PLACEHOLDER]
        slots = torch.tensor([int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in live],
                             dtype=torch.int64)
        writer.write_kv_cache(k[live], v[live], k_cache, v_cache, slots)
        queries.append(q)
        expected.append(dense_reference(q, k, v, scale, window, soft_cap))
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    args = (torch.cat(queries), k_cache, v_cache, tables, seq_lens, qsl, scale, max(q_lens), int(seq_lens.max()))
    return args, torch.cat(expected)


# decode rows (before, at and past the window), whole prompts and chunks over a cached prefix
SEQS = [(1, 1), (5, 1), (17, 1), (64, 1), (100, 1), (30, 30), (90, 90), (77, 13), (41, 2), (130, 33)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 7, 8, 16, 21, 200])
@pytest.mark.parametrize("group", [1, 3])
def test_window_matches_dense_reference(backend, window, group):
    args, expected = make_case(SEQS, group, window, seed=window * 10 + group)
    out = get_backend(backend).paged_attention(*args, sliding_window=window)
    assert not torch.isnan(out).any()  # a placeholder or an unwritten slot was never read
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layers_alternating_windows_in_one_step(backend):
    # Qwen2's max_window_layers / interleaved layers: the same metadata with and without a window.
    attention = get_backend(backend)
    args, expected_full = make_case([(40, 1), (33, 9)], 2, None, seed=1)
    _, expected_window = make_case([(40, 1), (33, 9)], 2, 12, seed=1)
    for _ in range(2):  # the reference's per-window step plans are reused, never mixed up
        full = attention.paged_attention(*args)
        windowed = attention.paged_attention(*args, sliding_window=12)
        torch.testing.assert_close(full.double(), expected_full, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(windowed.double(), expected_window, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(full, windowed)


@pytest.mark.skipif(not toolchain_available(), reason="no C++ compiler / ninja: the CPU kernel cannot be built")
def test_cpu_kernel_equals_reference_with_window():
    args, _ = make_case(SEQS, 4, 19, seed=5)
    torch.testing.assert_close(get_backend("cpu").paged_attention(*args, sliding_window=19),
                               get_backend("torch").paged_attention(*args, sliding_window=19),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_soft_cap_matches_dense_reference(backend, window, group):
    # scores of a few units (q times 4) against a cap of 2: most of them are bent by the tanh
    args, expected = make_case(SEQS, group, window, seed=7 + group, soft_cap=2.0, q_mul=4.0)
    out = get_backend(backend).paged_attention(*args, sliding_window=window, logits_soft_cap=2.0)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    uncapped = get_backend(backend).paged_attention(*args, sliding_window=window)
    assert (uncapped - out).abs().max() > 0.1  # the cap matters in this case


@pytest.mark.skipif(not toolchain_available(), reason="no C++ compiler / ninja: the CPU kernel cannot be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_reference_with_soft_cap(dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for window in (None, 19):  # a windowed case has placeholder blocks only a window skips
        (query, k_cache, v_cache, *rest), _ = make_case(SEQS, 4, window, seed=11, soft_cap=3.0, q_mul=4.0)
        args = (query.to(dtype), k_cache.to(dtype), v_cache.to(dtype), *rest)
        torch.testing.assert_close(get_backend("cpu").paged_attention(*args, sliding_window=window,
                                                                      logits_soft_cap=3.0),
                                   get_backend("torch").paged_attention(*args, sliding_window=window,
                                                                        logits_soft_cap=3.0),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_soft_cap_raises(backend):
    args, _ = make_case([(10, 1)], 1, None)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        get_backend(backend).paged_attention(*args, logits_soft_cap=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_window_raises(backend):
    args, _ = make_case([(10, 1)], 1, None)
    with pytest.raises(ValueError, match="sliding_window"):
        get_backend(backend).paged_attention(*args, sliding_window=0)
