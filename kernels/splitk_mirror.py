"""The decode kernel's split-K plan, and a torch mirror of its algorithm for CPU tests.

`choose_num_splits` / `tokens_per_split` are what the CuPy backend launches with. `splitk_decode`
reproduces paged_decode.cu + its reduce step by step in fp32 (per split: online softmax over
tiles in the exp2 domain with scale*log2e folded into q, tokens >= seq_len never read, nor, with a
sliding window, tokens before it, the splits tiling the window from its first block; scores
soft-capped in the log2 domain when asked; then an LSE merge where empty splits weigh 0), so CPU CI can check the algorithm against an fp64 dense
reference without a GPU.
"""

from __future__ import annotations

import math

import torch

from pagoda.runtime.math_utils import cdiv

H100_SMS = 132
SPLIT_UNIT_TOKENS = 256  # the smallest KV span worth a CTA of its own
MAX_SPLITS = 128
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def num_splits_heuristic(num_ctas: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """FlashAttention-2's rule (flash_api.cpp): no split when the grid already fills ~80% of a wave;
    otherwise the smallest split count whose wave efficiency is within 85% of the best one. Counts
    that give the same blocks per split as the count below them are not eligible."""
    if num_ctas >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    if max_splits <= 1:
        return 1

    def eligible(splits: int) -> bool:
        return splits == 1 or cdiv(num_n_blocks, splits) != cdiv(num_n_blocks, splits - 1)

    efficiency = {}
    for splits in range(1, max_splits + 1):
        if eligible(splits):
            waves = num_ctas * splits / num_sms
            efficiency[splits] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return next(s for s, e in sorted(efficiency.items()) if e >= 0.85 * best)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = H100_SMS) -> int:
    # Two resident CTAs per SM count as one wave, as in FA2 (it passes 2 * SM count).
    return num_splits_heuristic(batch * num_kv_heads, 2 * num_sms,
                                cdiv(max(max_seq_len, 1), SPLIT_UNIT_TOKENS), MAX_SPLITS)


def tokens_per_split(max_seq_len: int, block_size: int, num_splits: int) -> int:
    """KV tokens per split: a whole number of blocks; trailing splits may be empty."""
    return cdiv(cdiv(max(max_seq_len, 1), num_splits), block_size) * block_size


def kernel_rows(head_dim: int, threads: int = 128) -> int:
    """Row groups per CTA in paged_decode.cu: D/8 lanes cover one token row."""
    return threads // (head_dim // 8)


def kernel_unroll(group: int) -> int:
    """Tokens each row group keeps in flight per pass (paged_decode.cu's Unroll<G>)."""
    return 8 if group <= 2 else (4 if group <= 4 else 2)


def splitk_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                  rows: int | None = None, unroll: int | None = None,
                  window: int = 0, soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, Hq, D] (one decode row per sequence) -> (out [B, Hq, D] fp32, lse [B, Hq] fp32, ln).

    rows / unroll: the kernel's row groups per CTA and tokens per row group per pass (defaults:
    the compiled kernel's). Row group r of a pass starting at `base` owns tokens base + u*rows + r.
    window: the kernel's sliding window (0: none): sequence b reads tokens >= seq_len - window.
    soft_cap: the kernel's logits soft cap (0: none), applied as cap*log2e * tanh(s / (cap*log2e))
    to the log2-unit scores, which is cap * tanh(score / cap) in natural units.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = rows or kernel_rows(head_dim)
    unroll = unroll or kernel_unroll(group)
    lens = seq_lens.long()  # [B]
    max_len = int(lens.max()) if num_seqs else 0
    # cupy_impl's span: the window from its first block, at most
    span_len = min(max_len, window + block_size) if window else max_len
    split_len = tokens_per_split(span_len, block_size, num_splits)
    lo = torch.clamp(lens - window, min=0) if window else torch.zeros_like(lens)  # [B] first token read
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim) * (scale * _LOG2E)  # [B,Hkv,G,D]
    part_o = []
    part_lse = []
    for split in range(num_splits):
        span = lo // block_size * block_size + split * split_len  # [B]
        starts = torch.maximum(lo, span)
        ends = torch.minimum(lens, span + split_len)  # [B]
        m, denom, acc = _split_states(q, k_cache, v_cache, block_tables, starts, ends, split_len, rows, unroll,
                                      soft_cap * _LOG2E)
        o, lse = _merge_row_groups(m, denom, acc)
        part_o.append(o)
        part_lse.append(lse)
    out, lse = merge_partials(torch.stack(part_o, -2), torch.stack(part_lse, -1))
    return out.view(num_seqs, num_heads, head_dim), lse.view(num_seqs, num_heads)


def _split_states(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, split_len: int,
                  rows: int, unroll: int, cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # q: [B, Hkv, G, D] in log2 units; starts, ends: [B] (each sequence's own, as each CTA's)
    # -> per row group: m, denom [B, Hkv, G, R] (log2 units), acc [B, Hkv, G, R, D] unnormalised
    num_seqs, num_kv_heads, group, head_dim = q.shape
    block_size = k_cache.shape[1]
    m = torch.full((num_seqs, num_kv_heads, group, rows), float("-inf"))
    denom = torch.zeros(num_seqs, num_kv_heads, group, rows)  # the kernel's l
    acc = torch.zeros(num_seqs, num_kv_heads, group, rows, head_dim)
    chunk = rows * unroll
    for offset in range(0, split_len, chunk):
        # [B, U*R], pos[b, u*R + r] = base_b + u*R + r with base_b = starts[b] + offset
        pos = starts[:, None] + offset + torch.arange(chunk)[None, :]
        valid = pos < ends[:, None]  # [B, U*R]
        if not bool(valid.any()):
            break  # the kernel's loop bound (base < end) for every sequence
        k, v = _load_tokens(k_cache, v_cache, block_tables, pos, valid, block_size)  # [B,U*R,Hkv,D]
        k = k.view(num_seqs, unroll, rows, num_kv_heads, head_dim)
        v = v.view(num_seqs, unroll, rows, num_kv_heads, head_dim)
        s = torch.einsum("bkgd,burkd->bkgru", q, k)  # [B, Hkv, G, R, U]
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        s = s.masked_fill(~valid.view(num_seqs, 1, 1, unroll, rows).transpose(-1, -2), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        # A row group that has seen no token yet subtracts 0, so exp2(-inf - 0) = 0, never NaN.
        m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - m_use)
        p = torch.exp2(s - m_use[..., None])  # masked tokens: exp2(-inf) = 0
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bkgru,burkd->bkgrd", p, v)
        m = m_new
    return m, denom, acc


def _merge_row_groups(m: torch.Tensor, denom: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The kernel's shared-memory merge: -> (o [B,Hkv,G,D] normalised, lse [B,Hkv,G] ln; 0 / -inf if empty)
    m_max = m.amax(-1)  # [B, Hkv, G]
    m_use = torch.where(m_max == float("-inf"), torch.zeros_like(m_max), m_max)
    w = torch.exp2(m - m_use[..., None])  # [B, Hkv, G, R]
    total = (denom * w).sum(-1)
    o_sum = (acc * w[..., None]).sum(-2)  # [B, Hkv, G, D]
    has_mass = total > 0
    safe = torch.where(has_mass, total, 1.0)
    o = torch.where(has_mass[..., None], o_sum / safe[..., None], 0.0)
    lse = torch.where(has_mass, (m_max + torch.log2(safe)) * _LN2, float("-inf"))
    return o, lse


def _load_tokens(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 pos: torch.Tensor, valid: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Invalid positions are never read: their block id is replaced by 0 and their values by 0,
    # so stale NaN slots and out-of-range table entries cannot leak in.
    # pos: [B, tile]
    num_blocks = block_tables.shape[1]
    table_col = torch.clamp(pos // block_size, max=num_blocks - 1)  # [B, tile]
    block = block_tables.long().gather(1, table_col)  # [B, tile]
    block = torch.where(valid, block, torch.zeros_like(block))
    offset = pos % block_size  # [B, tile]
    k = k_cache[block, offset].float()  # [B, tile, Hkv, D]
    v = v_cache[block, offset].float()
    keep = valid[:, :, None, None]
    return torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)


def merge_partials(part_o: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """part_o [..., S, D], part_lse [..., S] (ln) -> (out [..., D], lse [...]); all-empty -> 0, -inf."""
    lse_max = part_lse.amax(-1, keepdim=True)  # [..., 1]
    lse_use = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)
    w = torch.exp(part_lse - lse_use)  # -inf partials: weight 0
    w_sum = w.sum(-1)  # [...]
    safe = torch.where(w_sum > 0, w_sum, torch.ones_like(w_sum))
    weighted = torch.where(w[..., None] > 0, w[..., None] * part_o, 0.0).sum(-2)  # [..., D]
    out = torch.where((w_sum > 0)[..., None], weighted / safe[..., None], 0.0)
    lse = torch.where(w_sum > 0, lse_use.squeeze(-1) + torch.log(safe), float("-inf"))
    return out, lse
