"""The compiled CPU backend (`pagoda_cpu`, kernels/paged_attention/cpu_attention.cpp) against a
dense fp64 reference, over shuffled block pools with NaN-poisoned unwritten slots."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import default_backend_name, get_backend

BLOCK_SIZE = 16
NUM_KV_HEADS = 3  # SmolLM2-135M's


@pytest.fixture(scope="module")
def cpu():
    return get_backend("cpu")


def dense_reference(query, keys, values, scale):
    """query [q_len, Hq, D]; keys/values [ctx, Hkv, D] -> [q_len, Hq, D], fp64, lower-right causal."""
    q_len, num_heads, _ = query.shape
    ctx, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale  # [Hq, q_len, ctx]
    position = torch.arange(q_len)[:, None] + (ctx - q_len)  # [q_len, 1]
    scores.masked_fill_(torch.arange(ctx)[None, :] > position, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_case(seqs, group, *, dtype=torch.float32, head_dim=64, seed=0, poison=float("nan"),
              logit_scale=1.0, backend=None, cache_dtype=None):
    """seqs: list of (seq_len, q_len). Writes every context through `backend` (the CPU one by
    default) into a poisoned cache over a shuffled pool 3x the need; unused table entries hold
    out-of-range ids. Returns (args for paged_attention, expected fp64 output)."""
    gen = torch.Generator().manual_seed(seed)
    backend = backend or get_backend("cpu")
    num_heads = NUM_KV_HEADS * group
    needed = [math.ceil(s / BLOCK_SIZE) for s, _ in seqs]
    pool = 3 * sum(needed) + 4
    shape = (pool, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    cache_dtype = cache_dtype or dtype  # an FP8 cache: expected from the values it can hold
    k_cache, v_cache = torch.full(shape, poison, dtype=cache_dtype), torch.full(shape, poison, dtype=cache_dtype)
    perm = torch.randperm(pool, generator=gen).tolist()
    tables = torch.full((len(seqs), max(needed, default=0) + 1), pool + 1000, dtype=torch.int32)
    queries, expected = [], []
    scale = head_dim**-0.5
    for i, (seq_len, q_len) in enumerate(seqs):
        ids = [perm.pop() for _ in range(needed[i])]
        tables[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = (torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen) * logit_scale).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        q = (torch.randn(q_len, num_heads, head_dim, generator=gen) * logit_scale).to(dtype)
        slots = torch.tensor([ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)],
                             dtype=torch.int64)
        backend.write_kv_cache(k, v, k_cache, v_cache, slots)
        queries.append(q)
        expected.append(dense_reference(q, k.to(cache_dtype).to(dtype), v.to(cache_dtype).to(dtype), scale))
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    args = (torch.cat(queries), k_cache, v_cache, tables, seq_lens, qsl, scale, max(q_lens),
            int(seq_lens.max()))
    return args, torch.cat(expected)


def check_fp32(out, expected):
    assert out.dtype == torch.float32 and not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("seq_len", [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 513])
def test_decode_rows(cpu, group, seq_len):
    args, expected = make_case([(seq_len, 1), (max(1, seq_len // 3), 1), (seq_len + 5, 1)], group, seed=seq_len)
    check_fp32(cpu.paged_attention(*args), expected)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("seq_len", [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 513])
def test_whole_prompt(cpu, group, seq_len):
    args, expected = make_case([(seq_len, seq_len)], group, seed=seq_len)
    check_fp32(cpu.paged_attention(*args), expected)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(("seq_len", "q_len"), [(513, 100), (BLOCK_SIZE + 1, BLOCK_SIZE), (40, 7),
                                                (BLOCK_SIZE, 2), (300, 257)])
def test_chunk_over_cached_prefix(cpu, group, seq_len, q_len):
    args, expected = make_case([(seq_len, q_len)], group, seed=q_len)
    check_fp32(cpu.paged_attention(*args), expected)


@pytest.mark.parametrize("head_dim", [36, 64, 80, 128])  # 36: zero-padded to 40
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("poison", [float("nan"), 1e4])
def test_mixed_batch_with_padding_sequences(cpu, group, head_dim, poison):
    # decode rows, chunks over cached prefixes, whole prompts and q_len-0 padding in one call
    seqs = [(40, 7), (1, 1), (0, 0), (BLOCK_SIZE + 1, 1), (33, 33), (513, 1), (20, 0), (BLOCK_SIZE, 5),
            (200, 64), (BLOCK_SIZE - 1, 1), (0, 0)]
    args, expected = make_case(seqs, group, head_dim=head_dim, seed=group, poison=poison)
    out = cpu.paged_attention(*args)
    assert out.shape == (sum(q for _, q in seqs), NUM_KV_HEADS * group, head_dim)
    check_fp32(out, expected)


def test_large_logits(cpu):
    # |q.k| * scale around 50: the online softmax's running max must carry the whole range
    args, expected = make_case([(300, 1), (90, 40), (17, 1)], 4, seed=3, logit_scale=2.6)
    check_fp32(cpu.paged_attention(*args), expected)


def test_rows_outside_every_sequence_are_zero(cpu):
    args, expected = make_case([(30, 2), (0, 0), (17, 1)], 2, seed=5)
    query, *rest = args
    padded = torch.cat([torch.randn(2, *query.shape[1:]), query, torch.randn(3, *query.shape[1:])])
    qsl = rest[4] + 2  # the sequences own rows [2, 5); rows 0-1 and 5-7 belong to none
    out = cpu.paged_attention(padded, *rest[:4], qsl, *rest[5:])
    assert out.shape == padded.shape
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.equal(out[5:], torch.zeros_like(out[5:]))
    check_fp32(out[2:5], expected)


def test_strided_query(cpu):
    # the model's q may be a view of a fused qkv projection: token stride > Hq * D
    args, expected = make_case([(50, 6), (20, 1)], 3, seed=9)
    query = args[0]
    fused = torch.randn(query.shape[0], 2 * query.shape[1], query.shape[2])
    fused[:, :query.shape[1]] = query
    check_fp32(cpu.paged_attention(fused[:, :query.shape[1]], *args[1:]), expected)


def test_bitwise_repeatable_across_thread_counts(cpu):
    args, _ = make_case([(513, 1), (100, 64), (40, 1), (7, 7)], 3, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu.paged_attention(*args)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(cpu.paged_attention(*args), single)
        assert torch.equal(cpu.paged_attention(*args), single)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_close_to_fp64(cpu, dtype, tol):
    seqs = [(70, 9), (31, 1), (513, 1), (BLOCK_SIZE + 1, BLOCK_SIZE + 1), (0, 0)]
    args, expected = make_case(seqs, 4, dtype=dtype, seed=13)
    out = cpu.paged_attention(*args)
    assert out.dtype == dtype
    assert ((out.double() - expected).norm() / expected.norm()).item() < tol
    torch.testing.assert_close(out.double(), expected, atol=2 * tol, rtol=2 * tol)
    # FlashAttention's rule: no worse than twice the torch reference's own low-precision error
    ref_err = (get_backend("torch").paged_attention(*args).double() - expected).abs().max()
    assert (out.double() - expected).abs().max() <= 2 * ref_err + 1e-6


def test_matches_torch_backend(cpu):
    args, _ = make_case([(129, 1), (64, 64), (300, 20), (1, 1)], 3, seed=17)
    torch.testing.assert_close(cpu.paged_attention(*args), get_backend("torch").paged_attention(*args),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_equals_reference(cpu, dtype):
    gen = torch.Generator().manual_seed(19)
    shape = (6, BLOCK_SIZE, NUM_KV_HEADS, 64)
    key = torch.randn(5, NUM_KV_HEADS, 64, generator=gen).to(dtype)
    value = torch.randn(5, NUM_KV_HEADS, 64, generator=gen).to(dtype)
    slots = torch.tensor([5 * BLOCK_SIZE + 3, -1, 0, 2 * BLOCK_SIZE + 15, -1])
    caches = []
    for backend in (cpu, get_backend("torch")):
        k_cache, v_cache = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
        backend.write_kv_cache(key, value, k_cache, v_cache, slots)
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    # an fp32 key into a bf16 cache is rounded like the reference's .to()
    k_cache, v_cache = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    cpu.write_kv_cache(key.float(), value.float(), k_cache, v_cache, slots)
    assert torch.equal(k_cache[5, 3], key[0].float().to(torch.bfloat16))


def test_bad_metadata_raises_before_reading(cpu):
    args, _ = make_case([(40, 1), (20, 1)], 2, seed=23)
    query, k_cache, v_cache, tables, seq_lens, qsl, *rest = args
    bad = tables.clone()
    bad[1, 0] = k_cache.shape[0]  # a used entry out of range
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.paged_attention(query, k_cache, v_cache, bad, seq_lens, qsl, *rest)
    with pytest.raises(RuntimeError, match="q_len"):
        cpu.paged_attention(query[:1].expand(3, -1, -1), k_cache, v_cache, tables[:1],
                            torch.tensor([2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), *rest)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.write_kv_cache(query[:1, :NUM_KV_HEADS], query[:1, :NUM_KV_HEADS], k_cache, v_cache,
                           torch.tensor([k_cache.shape[0] * BLOCK_SIZE]))


def test_default_backend_on_cpu_is_the_compiled_one():
    assert default_backend_name(torch.device("cpu")) == "cpu"
    assert get_backend("cpu").name == "cpu"


def test_ops_pass_opcheck(cpu):
    """Schema, fake (meta) kernels and autograd registration hold: torch.compile can trace the model
    through the ops (kernels/cpu_extension.py registers the fakes)."""
    args, _ = make_case([(40, 7), (17, 1), (0, 0)], 3, seed=29)
    query, k_cache, v_cache, tables, seq_lens, qsl, scale, _, _ = args
    torch.library.opcheck(torch.ops.pagoda_cpu.paged_attention.default,
                          (query, k_cache, v_cache, tables, seq_lens, qsl, scale))
    key = torch.randn(3, NUM_KV_HEADS, 64)
    torch.library.opcheck(torch.ops.pagoda_cpu.write_kv_cache.default,
                          (key, key.clone(), k_cache.clone(), v_cache.clone(), torch.tensor([1, -1, 5])))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_is_decoded_on_load(cpu, cache_dtype, dtype):
    # decode rows and prefill chunks over a cached prefix, GQA 3; the cache holds one byte per value
    seqs = [(37, 1), (BLOCK_SIZE * 3, 5), (70, 70), (1, 1)]
    args, expected = make_case(seqs, 3, dtype=dtype, cache_dtype=cache_dtype, seed=11)
    assert args[1].dtype == cache_dtype and args[1].element_size() == 1
    out = cpu.paged_attention(*args)
    assert out.dtype == dtype and not torch.isnan(out).any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    # the torch reference backend reads the same FP8 cache the same way
    reference = get_backend("torch").paged_attention(*args)
    torch.testing.assert_close(reference.double(), out.double(), atol=tolerance, rtol=tolerance)
