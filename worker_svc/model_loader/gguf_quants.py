"""GGUF quantised blocks -> `QuantizedWeight` (worker_svc/models/quant_linear.py), exactly.

Each decoder takes a tensor's raw blocks (uint8 [blocks, bytes per block]) and returns its
integers, fp32 scales and mins with blocks as rows ([blocks, elements per block]); `decode` then
lays them out as the tensor's [N, K]. The scales are computed from the file's fp16 ones with the
same fp32 operations as gguf's numpy reference (`d * sc`, `dmin * m`), and a min is stored negated
(x - y == x + (-y) in IEEE arithmetic), so `QuantizedWeight.dequantize()` equals
`gguf.quants.dequantize` bit for bit; gguf_loader's dequantisers for the K-quants are that.

    Q8_0  34 B / 32:  fp16 d, int8 q[32]                      w = d * q
    Q4_0  18 B / 32:  fp16 d, nibbles                         w = d * (q - 8)
    Q4_1  20 B / 32:  fp16 d, fp16 m, nibbles                 w = d * q + m
    Q5_0  22 B / 32:  fp16 d, 32 fifth bits, nibbles          w = d * (q - 16)   (5-bit storage)
    Q5_1  24 B / 32:  fp16 d, fp16 m, 32 fifth bits, nibbles  w = d * q + m      (5-bit storage)
    Q4_K 144 B / 256: fp16 d, dmin, 12 B of 6-bit sc/m, 128 B nibbles (8 groups of 32)
                                                              w = (d * sc) * q - (dmin * m)
    Q5_K 176 B / 256: as Q4_K plus 32 B of fifth bits         (q 0..31: 5-bit storage)
    Q6_K 210 B / 256: 128 B low nibbles, 64 B high 2 bits, int8 sc[16], fp16 d
                                                              w = (d * sc) * (q - 32), groups of 16
                                                              (6-bit storage)
The 5- and 6-bit codes are repacked into quant_format's block layout (nibbles, then a plane of top
bits), as many bits per weight as the file.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from worker_svc.model_loader.quant_format import QuantizedWeight, pack_lowbit

# A block decoded: (q, scales, mins or None, bits, group, zero), blocks as rows.
Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int, int]


def _cols(b: torch.Tensor) -> torch.Tensor:
    """A column slice of the blocks, contiguous. Through numpy: torch's copy of a strided uint8
    view runs ~10x slower (18 ms against 1.5 ms for a 0.5B model's MLP matrix: seconds per start)."""
    return torch.from_numpy(np.ascontiguousarray(b.numpy()))


def _f16(b: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b.numpy()).view(np.float16).astype(np.float32))  # [n, 2] -> [n, 1]


def _q8_0(b: torch.Tensor) -> Decoded:
    return _cols(b[:, 2:]).view(torch.int8), _f16(b[:, :2]), None, 8, 32, 0


def _q4_0(b: torch.Tensor) -> Decoded:
    return _cols(b[:, 2:]), _f16(b[:, :2]), None, 4, 32, 8


def _q4_1(b: torch.Tensor) -> Decoded:
    return _cols(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 4, 32, 0


def _moved(b: torch.Tensor, *spans: tuple[int, int]) -> torch.Tensor:
    """The blocks' byte columns `spans` side by side (numpy, as _cols)."""
    a = b.numpy()
    out = np.empty((a.shape[0], sum(stop - start for start, stop in spans)), dtype=np.uint8)
    at = 0
    for start, stop in spans:
        out[:, at:at + stop - start] = a[:, start:stop]
        at += stop - start
    return torch.from_numpy(out)


def _q5_0(b: torch.Tensor) -> Decoded:
    # The 5-bit storage's block is the file's own bytes reordered: its 16 bytes of nibbles (element i
    # low, i + 16 high) then its 4 bytes of fifth bits (element j: bit j, little-endian), so a byte
    # copy, not an unpack and repack (~40% of a Q4_K_M start). The kernel widens q - 16 as an
    # integer: d * float(q - 16) is the file's product exactly.
    return _moved(b, (6, 22), (2, 6)), _f16(b[:, :2]), None, 5, 32, 16


def _q5_1(b: torch.Tensor) -> Decoded:
    return _moved(b, (8, 24), (4, 8)), _f16(b[:, :2]), _f16(b[:, 2:4]), 5, 32, 0


def _h(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)  # [n, 2] uint8 -> [n, 1] fp32


# The K-quants' bit fiddling in numpy: the same integer and fp32 operations as torch gave (bit for
# bit), on small strided views where torch's uint8 kernels were ~10x slower (issue 47: start time).
def _k_scales_np(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _h(a[:, :2]), _h(a[:, 2:4])
    s = a[:, 4:16].reshape(-1, 3, 4)
    sd, sm, smd = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=1).astype(np.float32)
    mn = np.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=1).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # a file's inf / NaN scales pass through, as torch's did
        return d * sc, -(dmin * mn)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the fp32 (d * sc) [n, 8] and negated (dmin * m) [n, 8] (gguf's get_scale_min)."""
    scales, mins = _k_scales_np(b.numpy())
    return torch.from_numpy(scales), torch.from_numpy(mins)


def _q4_k(b: torch.Tensor) -> Decoded:
    scales, mins = _k_scales(b)
    # 4 chunks of 32 bytes: byte j's low nibble is element j of group 2c, its high one of group 2c + 1.
    # Ours per group of 32: byte i = element i | element i + 16 << 4, straight from the file's bytes.
    qs = b.numpy()[:, 16:].reshape(-1, 4, 2, 16)
    lo, hi = qs[:, :, 0], qs[:, :, 1]  # bytes i and i + 16 of each chunk
    packed = np.stack([(lo & 0x0F) | (hi << 4), (lo >> 4) | (hi & 0xF0)], axis=2).reshape(-1, 128)
    return torch.from_numpy(packed), scales, mins, 4, 32, 0


def _q5_k(b: torch.Tensor) -> Decoded:
    scales, mins = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32)
    qs = b[:, 48:].reshape(-1, 4, 1, 32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1  # group j: bit j
    q = (low | (high << 4)).reshape(-1, 256)  # 0..31
    return pack_lowbit(q, 5), scales, mins, 5, 32, 0


def _q6_k(b: torch.Tensor) -> Decoded:
    a = b.numpy()
    ql = a[:, :128].reshape(-1, 2, 1, 64)  # two halves of 128 elements
    qh = a[:, 128:192].reshape(-1, 2, 1, 32)
    sc = np.ascontiguousarray(a[:, 192:208]).view(np.int8).astype(np.float32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).reshape(-1, 256)  # 0..63
    with np.errstate(invalid="ignore", over="ignore"):
        scales = _h(a[:, 208:210]) * sc
    return pack_lowbit(torch.from_numpy(q), 6), torch.from_numpy(scales), None, 6, 16, 32


# type name -> (bytes per block, elements per block, decoder)
DECODERS: dict[str, tuple[int, int, Callable[[torch.Tensor], Decoded]]] = {
    "Q8_0": (34, 32, _q8_0), "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1),
    "Q5_0": (22, 32, _q5_0), "Q5_1": (24, 32, _q5_1),
    "Q4_K": (144, 256, _q4_k), "Q5_K": (176, 256, _q5_k), "Q6_K": (210, 256, _q6_k),
}


def decode(raw: torch.Tensor, type_name: str, rows: int, cols: int) -> QuantizedWeight:
    """uint8 bytes of a GGUF tensor [rows, cols] (numpy order) -> its QuantizedWeight."""
    size, elements, fn = DECODERS[type_name]
    if cols % elements:
        raise ValueError(f"{type_name}: row length {cols} is not a multiple of its block ({elements})")
    q, scales, mins, bits, group, zero = fn(raw.reshape(-1, size))
    fix = lambda t: None if t is None else t.reshape(rows, -1).contiguous()  # noqa: E731
    return QuantizedWeight(fix(q), fix(scales), fix(mins), bits, group, zero, cols)


def dequantizer(type_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """gguf_loader's per-block dequantiser: blocks [n, bytes] -> fp32 [n, elements]."""
    _, elements, _ = DECODERS[type_name]
    return lambda blocks: decode(blocks, type_name, blocks.shape[0], elements).dequantize()
