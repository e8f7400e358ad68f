"""The split-K decode algorithm (torch mirror of paged_decode.cu) against an fp64 dense reference."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.splitk_mirror import (
    choose_num_splits,
    merge_partials,
    num_splits_heuristic,
    splitk_decode,
    tokens_per_split,
)

HEAD_DIM = 64
NUM_KV_HEADS = 2


def dense_reference(query, k_cache, v_cache, block_tables, seq_lens, scale, soft_cap=None):
    """fp64, one sequence at a time, straight from the definition. -> (out [B,Hq,D], lse [B,Hq])."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_seqs, num_heads), float("-inf"), dtype=torch.float64)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        blocks = block_tables[i, : math.ceil(seq_len / block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].double()  # [L, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].double()
        for h in range(num_heads):
            scores = k[:, h // group] @ query[i, h].double() * scale  # [L]
            if soft_cap is not None:
                scores = torch.tanh(scores / soft_cap) * soft_cap
            lse[i, h] = torch.logsumexp(scores, 0)
            out[i, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out, lse


def make_case(seq_lens, group, block_size, seed=0, logit_scale=1.0):
    """Random block tables over a pool 3x the need, NaN-poisoned cache, junk past each table's end."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    need = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(max(need), 1) + 1
    pool = 3 * max(sum(need), 1)
    shape = (pool, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    tables = torch.full((num_seqs, max_blocks), 10**6, dtype=torch.int32)  # out of range on purpose
    perm = torch.randperm(pool, generator=gen)
    used = 0
    for i, n in enumerate(seq_lens):
        tables[i, : need[i]] = perm[used : used + need[i]].int()
        used += need[i]
        for t in range(n):  # write only live tokens; the rest of each block stays NaN
            block, offset = tables[i, t // block_size], t % block_size
            k_cache[block, offset] = torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=gen) * logit_scale
            v_cache[block, offset] = torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=gen)
    query = torch.randn(num_seqs, NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


def check_against_reference(seq_lens, group, block_size, num_splits, logit_scale=1.0, rows=None):
    query, k_cache, v_cache, tables, lens = make_case(seq_lens, group, block_size, logit_scale=logit_scale)
    scale = HEAD_DIM**-0.5
    out, lse = splitk_decode(query, k_cache, v_cache, tables, lens, scale, num_splits, rows=rows)
    ref_out, ref_lse = dense_reference(query, k_cache, v_cache, tables, lens, scale)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    return out


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_edge_lengths_with_forced_splits(group, block_size):
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 513]
    for num_splits in (1, 3, 8):  # with 8 splits the short sequences have whole empty splits
        check_against_reference(seq_lens, group, block_size, num_splits)


def test_trailing_splits_empty_for_every_sequence():
    # 17 tokens, 4 splits of 16: splits 2 and 3 hold nothing for anyone.
    assert tokens_per_split(17, 16, 4) == 16
    check_against_reference([17, 3], group=2, block_size=16, num_splits=4)


def test_padding_sequence_gives_zeros_not_nan():
    out = check_against_reference([0, 5, 0], group=4, block_size=16, num_splits=3)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))


def test_large_logits():
    # |q.k|*scale around 50.
    check_against_reference([200, 513, 31], group=1, block_size=16, num_splits=5, logit_scale=6.0)


def test_row_groups_that_see_no_token_stay_finite():
    # 4 row groups of a 128-thread CTA at D=256; 2- and 3-token sequences leave groups empty.
    check_against_reference([2, 3, 9], group=8, block_size=16, num_splits=2, rows=4)


def test_split_and_unsplit_agree_closely():
    query, k_cache, v_cache, tables, lens = make_case([513, 77], 4, 16, seed=3)
    one, _ = splitk_decode(query, k_cache, v_cache, tables, lens, 0.125, 1)
    many, _ = splitk_decode(query, k_cache, v_cache, tables, lens, 0.125, 7)
    torch.testing.assert_close(many, one, atol=1e-6, rtol=1e-6)


def test_merge_gives_empty_partials_zero_weight():
    part_o = torch.tensor([[[1.0, 2.0], [float("nan"), float("nan")], [3.0, 4.0]]])  # [1, S=3, D=2]
    part_lse = torch.tensor([[0.0, float("-inf"), math.log(3.0)]])
    out, lse = merge_partials(part_o, part_lse)
    torch.testing.assert_close(out, torch.tensor([[(1 + 9) / 4, (2 + 12) / 4]]))
    torch.testing.assert_close(lse, torch.tensor([math.log(4.0)]))
    empty_out, empty_lse = merge_partials(torch.zeros(1, 2, 2), torch.full((1, 2), float("-inf")))
    assert torch.equal(empty_out, torch.zeros(1, 2)) and empty_lse.item() == float("-inf")


def test_heuristic_no_split_when_grid_fills_the_gpu():
    # Llama-3-8B decode at B=64: 64 * 8 KV heads = 512 CTAs >= 0.8 * 264.
    assert choose_num_splits(batch=64, num_kv_heads=8, max_seq_len=2048) == 1


def test_heuristic_single_long_sequence_uses_every_256_token_span():
    # 8 CTAs, 32 spans of 256: only 32 splits (256 CTAs, 97% of a 264-CTA wave) is within 85%.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=8192) == 32


def test_heuristic_picks_smallest_split_near_best_efficiency():
    # 64 CTAs, 8 spans: 4 splits (256 CTAs, 97%) ties 8 splits; the smaller wins. 5-7 are
    # ineligible (same 2 spans per split as 4).
    assert num_splits_heuristic(num_ctas=64, num_sms=264, num_n_blocks=8, max_splits=128) == 4
    assert choose_num_splits(batch=8, num_kv_heads=8, max_seq_len=2048) == 4


def test_heuristic_short_context_cannot_split():
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=200) == 1
    assert num_splits_heuristic(num_ctas=1, num_sms=264, num_n_blocks=1, max_splits=128) == 1


def test_tokens_per_split_is_whole_blocks():
    assert tokens_per_split(8192, 16, 32) == 256
    assert tokens_per_split(513, 32, 3) == 192  # ceil(513/3)=171 -> 6 blocks of 32
    assert tokens_per_split(0, 16, 1) == 16


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
@pytest.mark.parametrize("window", [1, 15, 16, 40, 600])
def test_sliding_window_reads_only_the_window(num_splits, window):
    # The kernel's window path: each sequence reads tokens >= seq_len - window, splits tile the
    # window from its first block. Table entries of blocks wholly before it are out of range and
    # their slots NaN (freed by the scheduler): reading one would raise or poison the output.
    block_size, seq_lens = 16, [513, 3, 0, 200, 47]
    query, k_cache, v_cache, tables, lens = make_case(seq_lens, 4, block_size, seed=window)
    scale = HEAD_DIM**-0.5
    expected, expected_lse = dense_reference_window(query, k_cache, v_cache, tables, lens, scale, window)
    for i, n in enumerate(seq_lens):
        tables[i, : max(0, n - window) // block_size] = 10**6
    out, lse = splitk_decode(query, k_cache, v_cache, tables, lens, scale, num_splits, window=window)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_soft_cap(num_splits):
    # Gemma 2's attn_logit_softcapping: scores of several units (logit_scale 4) against a cap of 2.
    query, k_cache, v_cache, tables, lens = make_case([513, 3, 0, 200, 47], 4, 16, seed=4, logit_scale=4.0)
    scale = HEAD_DIM**-0.5
    expected, expected_lse = dense_reference(query, k_cache, v_cache, tables, lens, scale, soft_cap=2.0)
    out, lse = splitk_decode(query, k_cache, v_cache, tables, lens, scale, num_splits, soft_cap=2.0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)
    uncapped, _ = dense_reference(query, k_cache, v_cache, tables, lens, scale)
    assert (uncapped - expected).abs().max() > 0.1  # the cap matters in this case


def dense_reference_window(query, k_cache, v_cache, tables, lens, scale, window):
    """dense_reference over each sequence's last `window` tokens (what its decode row sees)."""
    block_size = k_cache.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        lo = max(0, n - window)
        # The window's tokens re-packed from position 0: a table over the same blocks, shifted.
        k = k_cache[tables[i, : math.ceil(n / block_size)].long()].flatten(0, 1)[lo:n]
        v = v_cache[tables[i, : math.ceil(n / block_size)].long()].flatten(0, 1)[lo:n]
        pad = (-k.shape[0]) % block_size
        k = torch.cat([k, torch.zeros(pad, *k.shape[1:])]).view(-1, block_size, *k.shape[1:])
        v = torch.cat([v, torch.zeros(pad, *v.shape[1:])]).view(-1, block_size, *v.shape[1:])
        table = torch.arange(k.shape[0], dtype=torch.int32)[None, :]
        o, s = dense_reference(query[i:i + 1], k, v, table, torch.tensor([n - lo], dtype=torch.int32), scale)
        out[i], lse[i] = o[0], s[0]
    return out, lse
