"""`LoRALinear`: a fused projection plus the LoRA deltas of the step's adapters, computed for every
token in one segmented matmul (no loop over requests or adapters).

The step's tokens that use an adapter are grouped by adapter slot (`LoRABatch.rows`, built once per
step on the host) and cut into chunks of at most C rows of one slot each, C = the mean group size,
so padding never exceeds the real rows. Per projection that is: one gather of the rows into
[chunks, C, in], two `bmm`s against each chunk's slot matrices, one `index_add_` back. Base-model
tokens are never touched; a step without adapters costs one attribute check per projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(slots=True)
class LoRABatch:
    """Which rows of the step's flat batch get which adapter (device tensors, shared by all layers)."""

    rows: torch.Tensor  # [N] int64: token rows with an adapter, grouped by slot
    gather_rows: torch.Tensor  # [chunks, C] int64: rows of each chunk, padded with row 0
    chunk_slots: torch.Tensor  # [chunks] int64: the slot of each chunk
    valid: torch.Tensor  # [N] int64: where rows[i]'s delta sits in the flattened [chunks * C]
    targets: frozenset[str]  # projections some adapter of this step targets (others: skipped)


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
    chunk_len = -(-rows.size // starts.size)  # C: the mean group size, rounded up
    chunk_starts = np.concatenate([np.arange(s, e, chunk_len) for s, e in zip(starts, ends, strict=True)])
    chunk_ends = np.minimum(chunk_starts + chunk_len, np.repeat(ends, -(-(ends - starts) // chunk_len)))
    lengths = chunk_ends - chunk_starts  # [chunks]
    offsets = np.arange(chunk_len)[None, :]  # [1, C]
    gather = np.where(offsets < lengths[:, None], chunk_starts[:, None] + offsets, -1)  # into rows
    valid = np.flatnonzero(gather.ravel() >= 0)
    gather_rows = np.where(gather >= 0, rows[np.maximum(gather, 0)], 0)

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

    return LoRABatch(to_device(rows), to_device(gather_rows), to_device(slots[chunk_starts]),
                     to_device(valid), targets)


def segmented_lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         batch: LoRABatch) -> torch.Tensor:
    """x: [T, in]; lora_a: [slots, in, W]; lora_b: [slots, W, out] -> deltas [N, out] of batch.rows."""
    xs = x[batch.gather_rows]  # [chunks, C, in]
    shrunk = torch.bmm(xs, lora_a[batch.chunk_slots])  # [chunks, C, W]
    expanded = torch.bmm(shrunk, lora_b[batch.chunk_slots])  # [chunks, C, out]
    return expanded.view(-1, expanded.shape[-1])[batch.valid]  # [N, out]


class LoRALinear(nn.Module):
    """`base(x)` plus, for the step's adapter rows, their LoRA delta. The slot matrices live here;
    the step's LoRABatch is read from `owner.batch` (the LoRAManager sets it around each forward)."""

    def __init__(self, base: nn.Module, proj: str, layer: int, in_features: int, width: int,
                 out_features: int, num_slots: int, owner: object, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.base, self.proj, self.layer = base, proj, layer
        self.owner = owner
        # Plain attributes, not parameters or buffers: never part of the model's state dict.
        self.lora_a = torch.zeros(num_slots, in_features, width, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, width, out_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        y = self.base(x)
        batch: LoRABatch | None = self.owner.batch  # type: ignore[attr-defined]
        if batch is None or self.proj not in batch.targets:
            return y
        return y.index_add_(0, batch.rows, segmented_lora_delta(x, self.lora_a, self.lora_b, batch))

    def extra_repr(self) -> str:
        return f"proj={self.proj}, layer={self.layer}, slots={self.lora_a.shape[0]}"
