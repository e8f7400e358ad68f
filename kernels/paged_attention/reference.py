"""Torch reference backend: paged KV-cache write and paged attention (CPU serving path, any device).

Signatures and cache layout are those of `kernels/__init__.py`:
k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].

Every layer of a step calls `paged_attention` with the same metadata tensors, so everything derived
from metadata alone (which rows decode, length buckets, flat slot indices, masks) is built once per
step as a `_StepPlan` and reused while the metadata that comes back is equal to the plan's copy of
it (a content check of three small tensors costs microseconds; the plan costs far more).

Decode rows (q_len == 1) are batched by similar context length. Each layer gathers the group's K/V
with one `index_select` over precomputed flat slots ([B * ctx], padding pointing at the sequence's
own position-0 slot, which is written, so no stale NaN can leak in), then one batched matmul pair
per KV head with a precomputed additive mask. Sequences with q_len > 1 (prefill chunks, possibly
over a cached prefix) run one SDPA call each with an explicit lower-right causal mask (SDPA's
`is_causal` is top-left aligned). Rows outside every sequence come back zero.
Softmax runs in fp32 for half-precision inputs (in the input dtype otherwise).

Sliding window (`sliding_window=W`, HF's convention): the row at position p sees keys at positions
p - W < k <= p. Only positions some row of the sequence can see are gathered, so a block wholly
before the window (freed by the scheduler, its table entry a placeholder) is never read. Layers of
one step may differ in window (Qwen2's max_window_layers, interleaved local/global layers): one
plan is kept per window.

Soft-capped scores (`logits_soft_cap=C`, Gemma 2): C * tanh(scale * q.k / C) before the mask and the
softmax, as HF's eager attention does. SDPA cannot cap its scores, so capped prefill rows take an
explicit matmul-softmax-matmul path instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Longest / shortest context allowed in one decode group. Measured on the offline benchmark's
# trajectory: 1.1, 1.25 and 1.5 (less padding, more calls) were no faster than 2.
_BUCKET_RATIO = 2.0
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


@dataclass(slots=True)
class _PrefillSeq:
    start: int  # query rows [start, end)
    end: int
    slots: torch.Tensor  # [ctx] int64: flat cache slots of positions lo..seq_len-1 (lo: window start)
    visible: torch.Tensor | None  # [q_len, ctx] bool lower-right causal (and window); None: plain causal


@dataclass(slots=True)
class _DecodeGroup:
    rows: torch.Tensor  # [B] int64: query rows
    slots: torch.Tensor  # [B * ctx] int64; padding -> the slot of the sequence's first visible position
    visible: torch.Tensor  # [B, 1, ctx] bool
    ctx: int


@dataclass(slots=True)
class _StepPlan:
    """Everything paged_attention needs that depends on metadata only (one step, every layer)."""

    key: tuple  # copies of the metadata it was built from, the block size and the window
    prefills: list[_PrefillSeq]
    decode_groups: list[_DecodeGroup]
    covered: tuple[int, int, int]  # (first row, end row, rows owned): zero-fill unless exact
    # compute dtype -> (additive mask per prefill (None: plain causal), per decode group), lazily
    masks: dict[torch.dtype, tuple[list[torch.Tensor | None], list[torch.Tensor]]]

    def additive_masks(self, dtype: torch.dtype) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        if dtype not in self.masks:
            self.masks[dtype] = ([None if p.visible is None else _additive_mask(p.visible, dtype)
                                  for p in self.prefills],
                                 [_additive_mask(g.visible, dtype) for g in self.decode_groups])
        return self.masks[dtype]


def _plan_key(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
              block_size: int, window: int | None) -> tuple:
    # Copies: compared by content, so a tensor mutated in place or a recycled id cannot fool it
    # (inference tensors have no version counter to check instead).
    return (block_tables.clone(), seq_lens.clone(), query_start_loc.clone(), block_size, window)


def _same_key(plan_key: tuple, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, block_size: int, window: int | None) -> bool:
    tables, lens, starts, size, plan_window = plan_key
    return (size == block_size and plan_window == window and _equal(tables, block_tables)
            and _equal(lens, seq_lens) and _equal(starts, query_start_loc))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


class TorchBackend:
    name = "torch"

    def __init__(self) -> None:
        self._plans: dict[int | None, _StepPlan] = {}  # the last step's plan, per window

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
        for rows, cache in ((key, k_cache), (value, v_cache)):
            rows = rows.to(cache.dtype)
            if cache.dtype in _FP8_DTYPES:  # index_copy_ has no float8 kernels: copy the bytes
                rows, cache = rows.view(torch.uint8), cache.view(torch.uint8)
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, rows)

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None) -> torch.Tensor:
        # query: [T, Hq, D] -> out: [T, Hq, D]
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        plan = self._step_plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1], sliding_window)
        num_rows = query.shape[0]
        exact = plan.covered == (0, num_rows, num_rows)
        out = torch.empty_like(query) if exact else torch.zeros_like(query)
        dtype = _compute_dtype(query.dtype)
        prefill_masks, decode_masks = plan.additive_masks(dtype)
        # [num_slots, Hkv, D] views of the caches
        k_flat = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        v_flat = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
        for seq, mask in zip(plan.prefills, prefill_masks, strict=True):
            out[seq.start:seq.end] = _prefill_one(query[seq.start:seq.end], k_flat, v_flat, seq.slots,
                                                  mask, scale, logits_soft_cap)
        for group, mask in zip(plan.decode_groups, decode_masks, strict=True):
            o = _decode_batch(query.index_select(0, group.rows), k_flat, v_flat, group, mask, scale,
                              logits_soft_cap)
            out.index_copy_(0, group.rows, o)
        return out

    def _step_plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int, window: int | None) -> _StepPlan:
        if window is not None and window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {window}")
        plan = self._plans.get(window)
        if plan is None or not _same_key(plan.key, block_tables, seq_lens, query_start_loc, block_size,
                                         window):
            key = _plan_key(block_tables, seq_lens, query_start_loc, block_size, window)
            plan = _build_plan(key, block_tables, seq_lens, query_start_loc, block_size, window)
            self._plans[window] = plan
        return plan


def _build_plan(key: tuple, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, block_size: int, window: int | None) -> _StepPlan:
    seq_lens_list = seq_lens.tolist()
    qsl = query_start_loc.tolist()
    prefills: list[_PrefillSeq] = []
    decode_seqs: list[int] = []
    owned = 0
    for i, seq_len in enumerate(seq_lens_list):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue  # padding sequence
        if q_len > seq_len:
            raise ValueError(f"sequence {i}: q_len {q_len} > seq_len {seq_len}")
        owned += q_len
        if q_len == 1:
            decode_seqs.append(i)
        else:
            prefills.append(_prefill_seq(block_tables[i], qsl[i], q_len, seq_len, block_size, window))
    # A decode row sees its last min(seq_len, window) positions: bucket by that, not seq_len.
    starts = [_window_start(n, 1, window) for n in seq_lens_list]
    seen = [n - lo for n, lo in zip(seq_lens_list, starts, strict=True)]
    groups = [_decode_group(block_tables, seq_lens_list, starts, qsl, group, block_size)
              for group in _length_buckets(decode_seqs, seen)]
    first = qsl[0] if qsl else 0
    end = qsl[-1] if qsl else 0
    return _StepPlan(key, prefills, groups, (first, end, owned), {})


def _length_buckets(seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Decode sequences grouped so that each group's longest is at most _BUCKET_RATIO times its
    shortest: a group is padded to its longest context, so this bounds the wasted gather and matmul
    work, at the price of one more call per group and layer."""
    groups: list[list[int]] = []
    for i in sorted(seqs, key=lambda i: -seq_lens[i]):
        if groups and _BUCKET_RATIO * seq_lens[i] >= seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _window_start(seq_len: int, q_len: int, window: int | None) -> int:
    """The first position any of the sequence's query rows can see (its first row's window)."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    # tables: [B, max_blocks]; positions: [B, n] (each < its sequence's length) -> [B, n] int64
    blocks = tables.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def _prefill_seq(block_table: torch.Tensor, start: int, q_len: int, seq_len: int,
                 block_size: int, window: int | None) -> _PrefillSeq:
    device = block_table.device
    lo = _window_start(seq_len, q_len, window)
    positions = torch.arange(lo, seq_len, device=device)[None, :]  # [1, ctx]
    slots = _slots(block_table[None, :], positions, block_size)[0]  # [ctx]
    visible = None  # no cached prefix: top-left == lower-right causal
    if q_len != seq_len or window is not None:
        # Lower-right causal: query row j sits at position p = seq_len - q_len + j, column c at lo + c;
        # visible iff p - window < lo + c <= p.
        ctx = seq_len - lo
        visible = torch.ones(q_len, ctx, dtype=torch.bool, device=device).tril(seq_len - q_len - lo)
        if window is not None:
            visible.triu_(seq_len - q_len - lo - window + 1)
    return _PrefillSeq(start, start + q_len, slots, visible)


def _decode_group(block_tables: torch.Tensor, seq_lens: list[int], starts: list[int], qsl: list[int],
                  group: list[int], block_size: int) -> _DecodeGroup:
    # starts[i]: sequence i's first visible position (0 without a window); column c is position
    # starts[i] + c.
    device = block_tables.device
    ctx = max(seq_lens[i] - starts[i] for i in group)
    index = torch.tensor(group, dtype=torch.long, device=device)  # [B]
    lens = torch.tensor([seq_lens[i] - starts[i] for i in group], device=device)  # [B] visible columns
    first = torch.tensor([starts[i] for i in group], device=device)[:, None]  # [B, 1]
    columns = torch.arange(ctx, device=device)[None, :]  # [1, ctx]
    visible = columns < lens[:, None]  # [B, ctx]
    # Padding reads the first visible position (written): entries past a table's end, and blocks
    # before the window, are never touched.
    slots = _slots(block_tables.index_select(0, index), first + torch.where(visible, columns, 0), block_size)
    rows = torch.tensor([qsl[i] for i in group], dtype=torch.long, device=device)
    return _DecodeGroup(rows, slots.reshape(-1), visible[:, None, :], ctx)


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # bool -> 0 / -inf in `dtype` (SDPA's CPU kernel runs about twice as fast with a float mask)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # An FP8 cache gathers as bytes: index_select over uint8 exists on every device and torch
    # version, the float8 dtypes' coverage does not (the CuPy backend's prefill rows come here).
    if flat.dtype in _FP8_DTYPES:
        return flat.view(torch.uint8).index_select(0, slots).view(flat.dtype)
    return flat.index_select(0, slots)


def _prefill_one(query: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor | None, scale: float, soft_cap: float | None = None) -> torch.Tensor:
    # query: [q_len, Hq, D]; k_flat, v_flat: [num_slots, Hkv, D] -> [q_len, Hq, D]
    dtype = _compute_dtype(query.dtype)
    q = query.transpose(0, 1).unsqueeze(0).to(dtype)  # [1, Hq, q_len, D]
    k = _gather(k_flat, slots).transpose(0, 1).unsqueeze(0).to(dtype)  # [1, Hkv, ctx, D]
    v = _gather(v_flat, slots).transpose(0, 1).unsqueeze(0).to(dtype)
    if soft_cap is not None:
        return _capped_prefill(q, k, v, mask, scale, soft_cap).to(query.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True)  # [1, Hq, q_len, D]
    return o[0].transpose(0, 1).to(query.dtype)


def _soft_cap(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    return scores if soft_cap is None else torch.tanh(scores / soft_cap) * soft_cap


def _capped_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, soft_cap: float) -> torch.Tensor:
    # q: [1, Hq, q_len, D]; k, v: [1, Hkv, ctx, D]; mask: [q_len, ctx] additive (None: plain causal,
    # q_len == ctx) -> [q_len, Hq, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [1, Hq, ctx, D]
    scores = _soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, soft_cap)  # [1, Hq, q_len, ctx]
    if mask is None:
        mask = _additive_mask(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(),
                              scores.dtype)
    o = torch.matmul(torch.softmax(scores + mask, dim=-1), v)  # [1, Hq, q_len, D]
    return o[0].transpose(0, 1)


def _decode_batch(query: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                  group: _DecodeGroup, mask: torch.Tensor, scale: float,
                  soft_cap: float | None = None) -> torch.Tensor:
    # query: [B, Hq, D] (one row per sequence, at position seq_len - 1); mask: [B, 1, ctx]
    # -> [B, Hq, D]
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_flat.shape[1]
    group_size = num_heads // num_kv_heads
    dtype = _compute_dtype(query.dtype)
    k = _gather(k_flat, group.slots).view(batch, group.ctx, num_kv_heads, head_dim).to(dtype)
    v = _gather(v_flat, group.slots).view(batch, group.ctx, num_kv_heads, head_dim).to(dtype)
    q = query.to(dtype).view(batch, num_kv_heads, group_size, head_dim)
    out = torch.empty(batch, num_kv_heads, group_size, head_dim, dtype=dtype, device=query.device)
    for h in range(num_kv_heads):
        # [B, G, D] x [B, D, ctx] -> scores [B, G, ctx]; padding columns get -inf from the mask
        if soft_cap is None:
            scores = torch.baddbmm(mask, q[:, h], k[:, :, h].transpose(1, 2), alpha=scale)
        else:  # the cap goes on the scores before the mask is added
            scores = _soft_cap(torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)) * scale, soft_cap) + mask
        torch.bmm(torch.softmax(scores, dim=-1), v[:, :, h], out=out[:, h])
    return out.view(batch, num_heads, head_dim).to(query.dtype)
