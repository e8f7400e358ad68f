"""The storage format of weight-only quantized linears: a `QuantizedWeight` (int8 or packed int4
integers, fp32 per-group scales and optional mins), stacking fused parts, and quantizing float
weights at load (`--quantization int8|int4`). The layer that multiplies by it is
worker_svc/models/quant_linear.py; GGUF blocks decode to it in gguf_quants.py. Here, not in
worker_svc/models, because the GGUF reader (under model_loader) builds these.

    w[n, k] = scales[n, k // group] * (q[n, k] - zero)  (+ mins[n, k // group])

    bits 8: qweight int8 [N, K]        Q8_0 (g32), int8 at load; any mix of formats (concat)
    bits 4: qweight uint8 [N, K/2]     Q4_0 (g32, zero 8), Q4_1 and Q4_K (g32, mins)
            (in each group, byte i holds element i in its low nibble, element i + group/2 in its
            high one: the Q4_0 / Q4_1 block layout; Q4_K's 64-element chunks are repacked to it)
    bits 5: qweight uint8 [N, K*5/8]   Q5_0 (g32, zero 16), Q5_1 and Q5_K (g32, mins)
    bits 6: qweight uint8 [N, K*6/8]   Q6_K (g16, zero 32)
            (in blocks of 32 elements whatever the group: 16 bytes of low nibbles, element i low and
            i + 16 high, then the high bits, little-endian: 4 bytes holding element j's fifth bit at
            bit j, or 8 bytes holding element j's two top bits at bits 2j, 2j+1. One byte per 5- or
            6-bit code would cost 1.6 / 1.33x the file; kernels/linear/cpu_quant_linear_lowbit.cpp
            widens these in registers.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def _cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat of CPU tensors through numpy: on the shared 2-core machine torch's cat of a fused
    projection's parts took ~14 ms where numpy takes 0.1 (issue 47: ~2 s of a Qwen2.5 worker's start)."""
    if any(t.device.type != "cpu" or t.dtype == torch.bfloat16 or t.requires_grad for t in tensors):
        return torch.cat(tensors, dim=dim)
    return torch.from_numpy(np.concatenate([t.numpy() for t in tensors], axis=dim))


@dataclass
class QuantizedWeight:
    """A [N, K] weight in the format above (K: the unpacked row length)."""

    qweight: torch.Tensor  # int8 [N, K] or uint8 [N, K/2]
    scales: torch.Tensor  # fp32 [N, K/group] (fp16 for Q8_0 as stored: quant_linear.keep_half_scales)
    mins: torch.Tensor | None  # fp32 [N, K/group] or None
    bits: int
    group: int
    zero: int = 0
    in_features: int = 0
    # Rows interleaved by 16 (8-bit codes in groups of 32, no mins): qweight int8 [N/16, K/2, 32] --
    # per 16 rows, each pair of columns holds the 16 rows' two codes side by side -- and scales
    # [N/16, K/32, 16]. The int16 dot-product kernel multiplies an activation pair into 16 rows per
    # instruction and streams the weights in one sequential pass (interleave_rows, docs/quantization.md).
    interleaved: bool = False

    def __post_init__(self) -> None:
        if not self.in_features:
            self.in_features = self.qweight.shape[1] * (2 if self.interleaved else 8 // self.bits)
        if self.in_features % self.group or (self.bits == 4 and self.group % 2) or (
                self.bits in LOWBIT and (self.in_features % LOWBIT_BLOCK or self.group % 16)):
            raise ValueError(f"group {self.group} does not fit K {self.in_features} ({self.bits} bits)")

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0] * (ROW_TILE if self.interleaved else 1), self.in_features

    @property
    def can_interleave(self) -> bool:
        """Row-major 8-bit codes in groups of 32 without mins, in whole tiles of 16 rows."""
        return (not self.interleaved and (self.bits, self.group) == (8, GROUP) and self.mins is None
                and self.shape[0] % ROW_TILE == 0)

    def interleave_rows(self) -> QuantizedWeight:
        """The same weights with rows interleaved by 16 (see `interleaved`); the same bytes."""
        n, k = self.shape
        if not self.can_interleave:
            raise ValueError("rows interleave for 8-bit codes in groups of 32 without mins, N a multiple of 16")
        q = self.qweight.view(n // ROW_TILE, ROW_TILE, k // 2, 2).transpose(1, 2).contiguous()
        s = self.scales.view(n // ROW_TILE, ROW_TILE, k // GROUP).transpose(1, 2).contiguous()
        return QuantizedWeight(q.view(n // ROW_TILE, k // 2, 2 * ROW_TILE), s, None, 8, GROUP, 0, k, True)

    def row_major(self) -> QuantizedWeight:
        """[N, K] rows again (a copy where interleaved, else self)."""
        if not self.interleaved:
            return self
        n, k = self.shape
        q = self.qweight.view(n // ROW_TILE, k // 2, ROW_TILE, 2).transpose(1, 2).reshape(n, k)
        s = self.scales.transpose(1, 2).reshape(n, k // GROUP)
        return QuantizedWeight(q, s, None, 8, GROUP, 0, k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation, a gather of token ids) in the same format, row-major."""
        if self.interleaved:  # only the rows asked for are copied (the embedding gather of a tied head)
            n, k = self.shape
            tile, row = index // ROW_TILE, index % ROW_TILE
            q = self.qweight.view(n // ROW_TILE, k // 2, ROW_TILE, 2)[tile, :, row].reshape(-1, k)
            return QuantizedWeight(q, self.scales[tile, :, row], None, 8, GROUP, 0, k)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return QuantizedWeight(pick(self.qweight), pick(self.scales), pick(self.mins), self.bits, self.group,
                               self.zero, self.in_features)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        if dim != 0:
            raise ValueError("a quantized weight is sliced by rows only")
        if self.interleaved:
            return self.row_major().narrow(dim, start, length)
        cut = lambda t: None if t is None else t.narrow(0, start, length)  # noqa: E731
        return QuantizedWeight(cut(self.qweight), cut(self.scales), cut(self.mins), self.bits, self.group,
                               self.zero, self.in_features)

    def unpacked(self) -> torch.Tensor:
        """int8 [N, K]: q - zero (exact: 4-, 5- and 6-bit values fit in int8)."""
        if self.interleaved:
            return self.row_major().qweight
        if self.bits == 8:
            return self.qweight
        if self.bits in LOWBIT:
            return (unpack_lowbit(self.qweight, self.bits).to(torch.int16) - self.zero).to(torch.int8)
        n, half = self.qweight.shape[0], self.group // 2
        b = self.qweight.view(n, -1, half)
        q = _cat([b & 0x0F, b >> 4], dim=2).to(torch.int16) - self.zero  # [N, K/group, group]
        return q.to(torch.int8).reshape(n, self.in_features)

    def widened(self, group: int, with_mins: bool) -> QuantizedWeight:
        """The same weights as int8 storage with groups of `group` (dividing ours) and mins if asked."""
        if self.interleaved:
            return self.row_major().widened(group, with_mins)
        repeat = self.group // group
        scales = self.scales.float().repeat_interleave(repeat, dim=1) if repeat > 1 else self.scales.float()
        mins = self.mins
        if mins is not None and repeat > 1:
            mins = mins.repeat_interleave(repeat, dim=1)
        if mins is None and with_mins:
            mins = torch.zeros_like(scales)  # s * q + 0 == s * q
        return QuantizedWeight(self.unpacked().contiguous(), scales.contiguous(), mins, 8, group, 0,
                               self.in_features)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], the reference: same two roundings as the kernel and as gguf's numpy."""
        if self.interleaved:
            return self.row_major().dequantize()
        n, g = self.qweight.shape[0], self.group
        q = self.unpacked().view(n, -1, g).float()
        w = self.scales.float().unsqueeze(-1) * q
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.reshape(n, self.in_features)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along N (a fused projection). Differing formats meet in int8 storage."""
    parts = [p.row_major() for p in parts]
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
    cat = lambda ts: None if ts[0] is None else _cat(ts)  # noqa: E731
    return QuantizedWeight(cat([p.qweight for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), first.bits, first.group, first.zero, first.in_features)


# -- quantization at load (HF directories, --quantization) ------------------------------------------

QUANTIZATION_METHODS = ("int8", "int4")
GROUP = 32
ROW_TILE = 16  # rows interleaved together (QuantizedWeight.interleaved)


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


LOWBIT = (5, 6)
LOWBIT_BLOCK = 32  # elements per packed block of the 5- and 6-bit storage


def pack_lowbit(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, K] values 0..2^bits-1 (bits 5 or 6) -> [N, K*bits/8] in the block layout above."""
    n, k = q.shape
    blocks = q.reshape(n, k // LOWBIT_BLOCK, LOWBIT_BLOCK)
    nibbles = pack_int4((blocks & 0x0F).reshape(n, k), LOWBIT_BLOCK).reshape(n, -1, 16)
    extra = bits - 4  # top bits per element, packed 8 / extra elements to a byte, little-endian
    top = (blocks >> 4).reshape(n, -1, 4 * extra, 8 // extra)  # element j: byte j // (8/extra)
    shifts = torch.arange(0, 8, extra, dtype=torch.uint8)
    plane = (top << shifts).sum(-1, dtype=torch.uint8).reshape(n, -1, 4 * extra)
    return _cat([nibbles, plane], dim=2).reshape(n, -1).contiguous()


def unpack_lowbit(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_lowbit`: uint8 [N, K*bits/8] -> uint8 [N, K] values 0..2^bits-1."""
    n, extra = packed.shape[0], bits - 4
    b = packed.reshape(n, -1, 16 + 4 * extra)  # [N, blocks, bytes per block]
    nib = b[:, :, :16]
    low = _cat([nib & 0x0F, nib >> 4], dim=2)  # [N, blocks, 32]
    shifts = torch.arange(0, 8, extra, dtype=torch.uint8)
    top = (b[:, :, 16:].unsqueeze(-1) >> shifts) & ((1 << extra) - 1)  # [N, blocks, 4*extra, 8/extra]
    return (low | (top.reshape(n, -1, LOWBIT_BLOCK) << 4)).reshape(n, -1)


def pack_int4(q: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> [N, K/2]: per group, element i low nibble, i + group/2 high."""
    n, k = q.shape
    g = q.reshape(n, k // group, 2, group // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
