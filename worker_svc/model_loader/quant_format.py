"""The storage format of weight-only quantized linears: a `QuantizedWeight` (int8 or packed int4
integers, fp32 per-group scales and optional mins), stacking fused parts, and quantizing float
weights at load (`--quantization int8|int4`). The layer that multiplies by it is
worker_svc/models/quant_linear.py; GGUF blocks decode to it in gguf_quants.py. Here, not in
worker_svc/models, because the GGUF reader (under model_loader) builds these.

    w[n, k] = scales[n, k // group] * (q[n, k] - zero)  (+ mins[n, k // group])

    bits 8: qweight int8 [N, K]      Q8_0 (g32), Q5_K (q 0..31, g32, mins), Q6_K (q-32, g16)
    bits 4: qweight uint8 [N, K/2]   Q4_0 (g32, zero 8), Q4_1 and Q4_K (g32, mins)
            (in each group, byte i holds element i in its low nibble, element i + group/2 in its
            high one: the Q4_0 / Q4_1 block layout; Q4_K's 64-element chunks are repacked to it)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """A [N, K] weight in the format above (K: the unpacked row length)."""

    qweight: torch.Tensor  # int8 [N, K] or uint8 [N, K/2]
    scales: torch.Tensor  # fp32 [N, K/group]
    mins: torch.Tensor | None  # fp32 [N, K/group] or None
    bits: int
    group: int
    zero: int = 0
    in_features: int = 0

    def __post_init__(self) -> None:
        if not self.in_features:
            self.in_features = self.qweight.shape[1] * (2 if self.bits == 4 else 1)
        if self.in_features % self.group or (self.bits == 4 and self.group % 2):
            raise ValueError(f"group {self.group} does not fit K {self.in_features} ({self.bits} bits)")

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation, a gather of token ids) in the same format."""
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return QuantizedWeight(pick(self.qweight), pick(self.scales), pick(self.mins), self.bits, self.group,
                               self.zero, self.in_features)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        if dim != 0:
            raise ValueError("a quantized weight is sliced by rows only")
        cut = lambda t: None if t is None else t.narrow(0, start, length)  # noqa: E731
        return QuantizedWeight(cut(self.qweight), cut(self.scales), cut(self.mins), self.bits, self.group,
                               self.zero, self.in_features)

    def unpacked(self) -> torch.Tensor:
        """int8 [N, K]: q - zero (exact: int4 values fit in int8)."""
        if self.bits == 8:
            return self.qweight
        n, half = self.qweight.shape[0], self.group // 2
        b = self.qweight.view(n, -1, half)
        q = torch.cat([b & 0x0F, b >> 4], dim=2).to(torch.int16) - self.zero  # [N, K/group, group]
        return q.to(torch.int8).reshape(n, self.in_features)

    def widened(self, group: int, with_mins: bool) -> QuantizedWeight:
        """The same weights as int8 storage with groups of `group` (dividing ours) and mins if asked."""
        repeat = self.group // group
        scales = self.scales.repeat_interleave(repeat, dim=1) if repeat > 1 else self.scales
        mins = self.mins
        if mins is not None and repeat > 1:
            mins = mins.repeat_interleave(repeat, dim=1)
        if mins is None and with_mins:
            mins = torch.zeros_like(scales)  # s * q + 0 == s * q
        return QuantizedWeight(self.unpacked().contiguous(), scales.contiguous(), mins, 8, group, 0,
                               self.in_features)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], the reference: same two roundings as the kernel and as gguf's numpy."""
        n, g = self.qweight.shape[0], self.group
        q = self.unpacked().view(n, -1, g).float()
        w = self.scales.unsqueeze(-1) * q
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.reshape(n, self.in_features)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along N (a fused projection). Differing formats meet in int8 storage."""
    first = parts[0]
    if len(parts) == 1:
        return first
    same = all((p.bits, p.group, p.zero, p.mins is None) == (first.bits, first.group, first.zero, first.mins is None)
               for p in parts)
    if not same:
        group = math.gcd(*(p.group for p in parts))
        with_mins = any(p.mins is not None for p in parts)
        parts = [p.widened(group, with_mins) for p in parts]
        first = parts[0]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return QuantizedWeight(cat([p.qweight for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), first.bits, first.group, first.zero, first.in_features)


# -- quantization at load (HF directories, --quantization) ------------------------------------------

QUANTIZATION_METHODS = ("int8", "int4")
GROUP = 32


def quantize(weight: torch.Tensor, method: str, group: int = GROUP) -> QuantizedWeight:
    """fp [N, K] -> int8 symmetric (as Q8_0: q = round(w / s), s = absmax / 127) or int4 affine
    (as Q4_1: q = round((w - min) / s), s = (max - min) / 15), per group of `group` along K
    (the whole row when K is not a multiple of it)."""
    n, k = weight.shape
    group = group if k % group == 0 else k
    w = weight.detach().float().reshape(n, k // group, group)
    if method == "int8":
        scale = w.abs().amax(-1) / 127
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round(w * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(q.reshape(n, k).contiguous(), scale.contiguous(), None, 8, group)
    if method == "int4":
        if group % 2:
            raise ValueError(f"int4 needs an even K, got {k}")
        lo, hi = w.amin(-1), w.amax(-1)
        scale = (hi - lo) / 15
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round((w - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
        return QuantizedWeight(pack_int4(q.reshape(n, k), group), scale.contiguous(), lo.contiguous(), 4, group)
    raise ValueError(f"unknown quantization {method!r}; choose {', '.join(QUANTIZATION_METHODS)}")


def pack_int4(q: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> [N, K/2]: per group, element i low nibble, i + group/2 high."""
    n, k = q.shape
    g = q.reshape(n, k // group, 2, group // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
