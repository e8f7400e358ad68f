"""`LoRALinear`: a fused projection plus the LoRA deltas of the step's adapters, computed for every
token in one segmented matmul (no loop over requests or adapters).

The runner orders the step's sequences by adapter slot (manager.py), so each adapter's tokens are
one block of rows. When the groups are equal (a balanced decode or prefill step), the delta is two
ops over views: `bmm` of x's block as [G, L, in] with the slots' A, then `baddbmm_` into y's block
(one per sub-projection: B is stored without the zero blocks of a block-diagonal layout).
Otherwise the adapter rows (`LoRABatch.rows`, built once per step on the host) are cut into chunks
of rows of one slot each, padded to one length C (see LoRABatch for the two layouts; padding never
exceeds about the real rows): one gather into [chunks, C, in], two `bmm`s against each chunk's slot
matrices, one `index_add_` back. Base-model
tokens are never touched; a step without adapters costs one attribute check per projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagoda.runtime.math_utils import cdiv

# Mean rows per adapter from which one matmul per adapter beats one padded batched matmul: below it
# (decode steps) the fixed cost of each op dominates; above it (prefill) padding and copies do.
SEGMENT_MIN_ROWS = 32


@dataclass(slots=True)
class LoRABatch:
    """Which rows of the step's flat batch get which adapter (device tensors, shared by all layers).

    Two layouts of the same thing, chosen per step by `build_lora_batch`:
    - by slot (`chunk_slots` None): chunk i holds the rows of slot `first_slot + i`, so the slot
      matrices are used in place (a view), no copy; taken when the groups are about equal (decode);
    - by chunk: groups cut into chunks of C rows, each chunk's slot matrices gathered; taken when
      one group dwarfs the others (a long prefill), where padding every slot to it would cost more.
    """

    rows: torch.Tensor  # [N] int64: token rows with an adapter, grouped by slot
    gather_rows: torch.Tensor  # [chunks, C] int64: rows of each chunk, padded with row 0
    valid: torch.Tensor | None  # [N] int64: where rows[i]'s delta sits in the flattened
    # [chunks * C]; None when nothing is padded (equal groups filling their slots: a mixed decode)
    targets: frozenset[str]  # projections some adapter of this step targets (others: skipped)
    chunk_slots: torch.Tensor | None = None  # [chunks] int64: the slot of each chunk (by chunk)
    first_slot: int = 0  # by slot: chunk i is slot first_slot + i
    # (first row, groups G, group length L, first slot) when the adapter rows are one block of G
    # equal groups of consecutive slots (a balanced step, the batch grouped by adapter): then x and
    # y are read and written through views, with no gather and no scatter.
    block: tuple[int, int, int, int] | None = None
    # (first row, end row, slot) per adapter when the adapter rows are contiguous and the groups long
    # (a prefill step): one matmul per adapter over its own rows, no padding, gather or scatter.
    segments: tuple[tuple[int, int, int], ...] | None = None


def build_lora_batch(token_slots: np.ndarray, targets: frozenset[str],
                     device: torch.device) -> LoRABatch | None:
    """token_slots: [T] int64, the adapter slot of each token of the step, -1 for the base model."""
    rows = np.flatnonzero(token_slots >= 0)
    if rows.size == 0:
        return None
    rows = rows[np.argsort(token_slots[rows], kind="stable")]  # grouped by slot, in batch order
    slots = token_slots[rows]
    starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])  # [G] group starts
    ends = np.r_[starts[1:], rows.size]
    first, span, longest = int(slots[0]), int(slots[-1] - slots[0]) + 1, int((ends - starts).max())
    if span * longest <= 2 * rows.size:  # by slot: padding at most doubles the rows
        chunk_len, chunk_starts, chunk_ends = longest, starts, ends
        chunk_index = slots[starts] - first  # each group's chunk is its slot's
        num_chunks, chunk_slots = span, None
    else:  # by chunk: C = the mean group size, so padding stays below the real rows plus one chunk per group
        chunk_len = cdiv(rows.size, starts.size)
        chunk_starts = np.concatenate([np.arange(s, e, chunk_len) for s, e in zip(starts, ends, strict=True)])
        chunk_ends = np.minimum(chunk_starts + chunk_len, np.repeat(ends, cdiv(ends - starts, chunk_len)))
        chunk_index = np.arange(chunk_starts.size)
        num_chunks, chunk_slots = chunk_starts.size, slots[chunk_starts]
    lengths = chunk_ends - chunk_starts
    offsets = np.arange(chunk_len)[None, :]  # [1, C]
    gather = np.full((num_chunks, chunk_len), -1, dtype=np.int64)  # positions into rows; -1: padding
    gather[chunk_index] = np.where(offsets < lengths[:, None], chunk_starts[:, None] + offsets, -1)
    valid = np.flatnonzero(gather.ravel() >= 0)
    gather_rows = np.where(gather >= 0, rows[np.maximum(gather, 0)], 0)

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

    return LoRABatch(to_device(rows), to_device(gather_rows),
                     None if valid.size == gather.size else to_device(valid), targets,
                     None if chunk_slots is None else to_device(chunk_slots), first,
                     _block(rows, slots[starts], ends - starts), _segments(rows, slots, starts, ends))


def _segments(rows: np.ndarray, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray
              ) -> tuple[tuple[int, int, int], ...] | None:
    contiguous = rows[-1] - rows[0] + 1 == rows.size
    if not contiguous or rows.size < SEGMENT_MIN_ROWS * starts.size:
        return None
    return tuple((int(rows[s]), int(rows[s]) + int(e - s), int(slots[s])) for s, e in zip(starts, ends, strict=True))


def _block(rows: np.ndarray, group_slots: np.ndarray, group_lens: np.ndarray) -> tuple[int, int, int, int] | None:
    contiguous = rows[-1] - rows[0] + 1 == rows.size and bool(np.all(np.diff(rows) == 1))
    equal = bool(np.all(group_lens == group_lens[0]))
    consecutive = bool(np.all(group_slots == group_slots[0] + np.arange(group_slots.size)))
    if not (contiguous and equal and consecutive):
        return None
    return int(rows[0]), int(group_slots.size), int(group_lens[0]), int(group_slots[0])


def expand_into(out: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor,
                subs: tuple[tuple[int, int, int, int], ...]) -> None:
    """out[..., c0:c1] += shrunk[..., r0:r1] @ lora_b[..., c0:c1] for each sub-projection
    (r0, r1, c0, c1): B is stored compact ([R, out], no zero blocks between q, k and v), so each
    sub-adapter multiplies only its own output columns. Strided views, no copies."""
    add_product = torch.Tensor.addmm_ if out.dim() == 2 else torch.Tensor.baddbmm_
    if len(subs) == 1:
        add_product(out, shrunk, lora_b)
        return
    for r0, r1, c0, c1 in subs:
        add_product(out[..., c0:c1], shrunk[..., r0:r1], lora_b[..., c0:c1])


def segmented_lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch,
                         subs: tuple[tuple[int, int, int, int], ...] | None = None) -> torch.Tensor:
    """x: [T, in]; lora_a: [slots, in, W]; lora_b: [slots, R, out] -> deltas [N, out] of batch.rows.
    `subs`: see expand_into; None: one sub-projection (W == R) over every output column."""
    if batch.chunk_slots is None:  # by slot: the matrices in place
        end = batch.first_slot + batch.gather_rows.shape[0]
        a, b = lora_a[batch.first_slot:end], lora_b[batch.first_slot:end]
    else:
        a, b = lora_a[batch.chunk_slots], lora_b[batch.chunk_slots]
    xs = x[batch.gather_rows]  # [chunks, C, in]
    shrunk = torch.bmm(xs, a)  # [chunks, C, W]
    expanded = shrunk.new_zeros(*shrunk.shape[:2], lora_b.shape[-1])  # [chunks, C, out]
    expand_into(expanded, shrunk, b, subs or ((0, a.shape[-1], 0, lora_b.shape[-1]),))
    flat = expanded.view(-1, expanded.shape[-1])  # [chunks * C, out]
    return flat if batch.valid is None else flat[batch.valid]  # [N, out]


class LoRALinear(nn.Module):
    """`base(x)` plus, for the step's adapter rows, their LoRA delta. The slot matrices live here;
    the step's LoRABatch is read from `owner.batch` (the LoRAManager sets it around each forward)."""

    def __init__(self, base: nn.Module, proj: str, layer: int, in_features: int, sub_out: tuple[int, ...],
                 rank: int, num_slots: int, owner: object, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.proj, self.layer = base, proj, layer
        self.owner = owner
        # (A columns, output columns) of each sub-projection (q, k, v / gate, up / the one)
        starts = [sum(sub_out[:i]) for i in range(len(sub_out))]
        self.subs = tuple((i * rank, (i + 1) * rank, starts[i], starts[i] + width)
                          for i, width in enumerate(sub_out))
        # Plain attributes, not parameters or buffers: never part of the model's state dict.
        self.lora_a = torch.zeros(num_slots, in_features, len(sub_out) * rank, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, rank, sum(sub_out), dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return self._add_delta(x, self.base(x))

    def partial_product(self, x: torch.Tensor) -> torch.Tensor:
        """Row-parallel under TP: this rank's x @ W.T plus its partial delta, no bias (the layer
        all-reduces the sum, then adds the bias once: models/llama.py `row_parallel`)."""
        return self._add_delta(x, nn.functional.linear(x, self.base.weight))

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def _add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch: LoRABatch | None = self.owner.batch  # type: ignore[attr-defined]
        if batch is None or self.proj not in batch.targets:
            return y
        if batch.segments is not None:  # prefill: one matmul per adapter over its own rows (views)
            for start, end, slot in batch.segments:
                expand_into(y[start:end], x[start:end] @ self.lora_a[slot], self.lora_b[slot], self.subs)
            return y
        if batch.block is not None:  # two ops over views: [G, L, in] @ A -> y += (.) @ B, in place
            start, groups, length, first = batch.block
            rows, slots = slice(start, start + groups * length), slice(first, first + groups)
            shrunk = torch.bmm(x[rows].reshape(groups, length, -1), self.lora_a[slots])  # [G, L, W]
            expand_into(y[rows].view(groups, length, -1), shrunk, self.lora_b[slots], self.subs)
            return y
        return y.index_add_(0, batch.rows, segmented_lora_delta(x, self.lora_a, self.lora_b, batch, self.subs))

    def extra_repr(self) -> str:
        return f"proj={self.proj}, layer={self.layer}, slots={self.lora_a.shape[0]}"
