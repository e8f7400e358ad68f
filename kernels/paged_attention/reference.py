"""Torch reference backend: paged KV-cache write and paged attention (CPU serving path, any device).

Signatures and cache layout are those of `kernels/__init__.py`:
k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].

Decode rows (q_len == 1) are batched by similar context length: their blocks are gathered into a
padded [B, Hkv, ctx, D] tensor per group, one SDPA call per group. Sequences with q_len > 1
(prefill chunks, possibly over a cached prefix) run one SDPA call each with an explicit lower-right
causal mask (SDPA's `is_causal` is top-left aligned). Rows outside every sequence come back zero.
Softmax runs in fp32 for half-precision inputs (in the input dtype otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class TorchBackend:
    name = "torch"

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # key, value: [T, Hkv, D]; slot_mapping: [T] int64, -1 = padding (skipped)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        valid = slot_mapping >= 0  # [T]
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        if slot_mapping.numel() == 0:
            return
        # view (not reshape): the write must land in the cache's own storage.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int) -> torch.Tensor:
        # query: [T, Hq, D] -> out: [T, Hq, D]
        out = torch.zeros_like(query)
        seq_lens_list = seq_lens.tolist()
        qsl = query_start_loc.tolist()
        decode_seqs: list[int] = []
        for i, seq_len in enumerate(seq_lens_list):
            q_len = qsl[i + 1] - qsl[i]
            if q_len == 0:
                continue  # padding sequence
            if q_len > seq_len:
                raise ValueError(f"sequence {i}: q_len {q_len} > seq_len {seq_len}")
            if q_len == 1:
                decode_seqs.append(i)
            else:
                out[qsl[i]:qsl[i + 1]] = _prefill_one(
                    query[qsl[i]:qsl[i + 1]], k_cache, v_cache, block_tables[i], seq_len, scale)
        for group in _length_buckets(decode_seqs, seq_lens_list):
            rows = [qsl[i] for i in group]
            lens = [seq_lens_list[i] for i in group]
            out[rows] = _decode_batch(query[rows], k_cache, v_cache, block_tables[group], lens, scale)
        return out


def _length_buckets(seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Decode sequences grouped so that each group's shortest is at least half its longest: a group
    is padded to its longest context, so this bounds the wasted work to 2x (log2(max/min) groups)."""
    groups: list[list[int]] = []
    for i in sorted(seqs, key=lambda i: -seq_lens[i]):
        if groups and 2 * seq_lens[i] >= seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    # block_table: [max_blocks] -> k, v: [seq_len, Hkv, D]
    block_size = k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # bool -> 0 / -inf in `dtype` (SDPA's CPU kernel runs about twice as fast with a float mask)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _prefill_one(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    # query: [q_len, Hq, D] -> [q_len, Hq, D]
    q_len = query.shape[0]
    k, v = _gather_context(k_cache, v_cache, block_table, seq_len)  # [ctx, Hkv, D]
    dtype = _compute_dtype(query.dtype)
    q = query.transpose(0, 1).unsqueeze(0).to(dtype)  # [1, Hq, q_len, D]
    k = k.transpose(0, 1).unsqueeze(0).to(dtype)  # [1, Hkv, ctx, D]
    v = v.transpose(0, 1).unsqueeze(0).to(dtype)
    if q_len == seq_len:
        mask = None  # no cached prefix: top-left == lower-right
    else:
        # Lower-right causal: query row j sits at position seq_len - q_len + j.
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).tril(seq_len - q_len)
        mask = _additive_mask(visible, dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True)  # [1, Hq, q_len, D]
    return o[0].transpose(0, 1).to(query.dtype)


def _decode_batch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: list[int], scale: float) -> torch.Tensor:
    # query: [B, Hq, D] (one row per sequence, at position seq_len - 1) -> [B, Hq, D]
    block_size = k_cache.shape[1]
    device = query.device
    lens = torch.tensor(seq_lens, device=device)  # [B]
    max_blocks = -(-max(seq_lens) // block_size)
    # Entries past a table's end may hold any value (even out of range): point them at block 0.
    table = block_tables[:, :max_blocks].long()  # [B, nb]
    used = torch.arange(max_blocks, device=device) < ((lens + block_size - 1) // block_size)[:, None]
    table = torch.where(used, table, torch.zeros_like(table))
    dtype = _compute_dtype(query.dtype)
    q = query.to(dtype).unsqueeze(2)  # [B, Hq, 1, D]
    k = k_cache[table].flatten(1, 2).transpose(1, 2).to(dtype)  # [B, Hkv, ctx, D]
    v = v_cache[table].flatten(1, 2).transpose(1, 2).to(dtype)
    visible = torch.arange(k.shape[2], device=device) < lens[:, None]  # [B, ctx]
    mask = _additive_mask(visible, dtype)[:, None, None, :]  # [B, 1, 1, ctx]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if bool(o.isnan().any()):
        # Stale slots past seq_len may hold NaN (NaN + -inf = NaN, 0 * NaN = NaN): redo with them
        # zeroed. Rare, so the common path skips two passes over K/V.
        hidden = ~visible[:, None, :, None]  # [B, 1, ctx, 1]
        k, v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[:, :, 0].to(query.dtype)  # [B, Hq, D]
