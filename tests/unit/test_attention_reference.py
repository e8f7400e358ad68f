"""The torch paged-attention backend against a plain dense fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import get_backend

BLOCK_SIZE = 16
HEAD_DIM = 32
NUM_KV_HEADS = 2


def dense_reference(query, keys, values, scale):
    """query [q_len, Hq, D]; keys/values [ctx, Hkv, D] -> [q_len, Hq, D], fp64, lower-right causal."""
    q_len, num_heads, _ = query.shape
    ctx, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for j in range(q_len):
        last_visible = ctx - q_len + j
        for h in range(num_heads):
            k = keys[: last_visible + 1, h // group].double()  # [n, D]
            v = values[: last_visible + 1, h // group].double()
            scores = k @ query[j, h].double() * scale  # [n]
            out[j, h] = torch.softmax(scores, dim=0) @ v
    return out


def run_case(seqs, group, *, dtype=torch.float32, seed=0, poison=float("nan")):
    """seqs: list of (seq_len, q_len). Builds a poisoned cache over a shuffled block pool, writes
    every sequence's context through write_kv_cache, and compares paged_attention to the reference."""
    gen = torch.Generator().manual_seed(seed)
    backend = get_backend("torch")
    num_heads = NUM_KV_HEADS * group
    blocks_needed = [math.ceil(s / BLOCK_SIZE) for s, _ in seqs]
    max_blocks = max(blocks_needed) + 1
    pool = 3 * sum(blocks_needed) + 4
    shape = (pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, poison, dtype=dtype)
    v_cache = torch.full(shape, poison, dtype=dtype)
    perm = torch.randperm(pool, generator=gen).tolist()
    # Unused table entries hold out-of-range ids: the backend must never read them.
    block_tables = torch.full((len(seqs), max_blocks), pool + 1000, dtype=torch.int32)
    keys, values, queries = [], [], []
    for i, (seq_len, q_len) in enumerate(seqs):
        ids = [perm.pop() for _ in range(blocks_needed[i])]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        slots = torch.tensor([ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)],
                             dtype=torch.int64)
        backend.write_kv_cache(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, num_heads, HEAD_DIM, generator=gen).to(dtype))
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    out = backend.paged_attention(torch.cat(queries), k_cache, v_cache, block_tables, seq_lens, qsl,
                                  scale, max(q_lens), int(seq_lens.max()))
    assert out.shape == (sum(q_lens), num_heads, HEAD_DIM) and out.dtype == dtype
    expected = torch.cat([dense_reference(q, k, v, scale) for q, k, v in zip(queries, keys, values, strict=True)])
    return out, expected


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("seq_len", [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 513])
def test_decode_matches_dense(group, seq_len):
    out, expected = run_case([(seq_len, 1), (max(1, seq_len // 3), 1)], group, seed=seq_len)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("seq_len", [BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 513])
def test_full_prefill_matches_dense(group, seq_len):
    out, expected = run_case([(seq_len, seq_len)], group, seed=seq_len)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("poison", [float("nan"), 1e4])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_prefill_chunks_and_decode_rows(group, poison):
    # cached prefix + chunk, a full prompt, decode rows of several lengths, a 1-token prompt
    seqs = [(40, 7), (1, 1), (BLOCK_SIZE + 1, 1), (33, 33), (513, 1), (BLOCK_SIZE, 5), (20, 1)]
    out, expected = run_case(seqs, group, seed=group, poison=poison)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_zero_length_padding_sequence_is_ignored():
    out, expected = run_case([(5, 1), (0, 0), (BLOCK_SIZE + 3, 4)], 2)
    assert out.shape[0] == 5
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_dense():
    out, expected = run_case([(70, 9), (31, 1)], 4, dtype=torch.bfloat16)
    err = (out.double() - expected).norm() / expected.norm()
    assert err < 1e-2


def test_write_kv_cache_skips_negative_slots():
    backend = get_backend("torch")
    k_cache = torch.zeros(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([2 * BLOCK_SIZE + 5, -1, 3 * BLOCK_SIZE])
    backend.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[2, 5], key[0]) and torch.equal(v_cache[2, 5], value[0])
    assert torch.equal(k_cache[3, 0], key[2]) and torch.equal(v_cache[3, 0], value[2])
    written = torch.zeros(4, BLOCK_SIZE, dtype=torch.bool)
    written[2, 5] = written[3, 0] = True
    assert k_cache[~written].abs().sum() == 0 and v_cache[~written].abs().sum() == 0
    # all slots -1: nothing written, no error
    backend.write_kv_cache(key, value, k_cache, v_cache, torch.full((3,), -1))
    assert int(written.sum()) == 2 and k_cache[~written].abs().sum() == 0


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_write_stores_torchs_bytes_and_reads_them_back(cache_dtype):
    # index_copy_ has no float8 kernels: the reference writes the bytes (the CuPy GPU tests and
    # `--attention-backend torch --kv-cache-dtype fp8` rely on this).
    backend = get_backend("torch")
    k_cache = torch.zeros(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) * 100
    value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    backend.write_kv_cache(key, value, k_cache, v_cache, torch.tensor([5, -1, BLOCK_SIZE + 2]))
    for cache, rows in ((k_cache, key), (v_cache, value)):
        assert torch.equal(cache[0, 5].view(torch.uint8), rows[0].to(cache_dtype).view(torch.uint8))
        assert torch.equal(cache[1, 2].view(torch.uint8), rows[2].to(cache_dtype).view(torch.uint8))
        assert int(cache.view(torch.uint8).count_nonzero()) == int(
            (rows[[0, 2]].to(cache_dtype).view(torch.uint8) != 0).sum())
    query = torch.randn(1, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    out = backend.paged_attention(query, k_cache, v_cache, torch.tensor([[1, 0]], dtype=torch.int32),
                                  torch.tensor([BLOCK_SIZE + 3], dtype=torch.int32),
                                  torch.tensor([0, 1], dtype=torch.int32), 0.125, 1, BLOCK_SIZE + 3)
    keys = torch.cat([k_cache[1], k_cache[0]])[: BLOCK_SIZE + 3].double()
    values = torch.cat([v_cache[1], v_cache[0]])[: BLOCK_SIZE + 3].double()
    expected = dense_reference(query, keys, values, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_metadata_changed_in_place_is_not_served_from_the_step_cache():
    """The backend reuses what it derives from the metadata across the layers of one step; the
    runner may rewrite the same tensors in place for the next step, which must not reuse it."""
    gen = torch.Generator().manual_seed(7)
    backend = get_backend("torch")
    pool, num_heads = 8, NUM_KV_HEADS * 2
    k_cache = torch.randn(pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    query = torch.randn(2, num_heads, HEAD_DIM, generator=gen)
    block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 9], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    args = (k_cache, v_cache, block_tables, seq_lens, qsl, HEAD_DIM**-0.5, 1, 20)
    backend.paged_attention(query, *args)  # fills the step cache
    block_tables[0] = torch.tensor([5, 6], dtype=torch.int32)  # the next step, same tensors
    seq_lens[1] = 16
    reused = backend.paged_attention(query, *args)
    fresh = get_backend("torch").paged_attention(query, *args)
    torch.testing.assert_close(reused, fresh, rtol=0, atol=0)
