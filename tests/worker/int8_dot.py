"""What the quantized linear's integer dot-product path (kernels/linear/cpu_quant_int8dot.cpp,
cpu_quant_int16dot.cpp) does to activations, restated in torch for the tests: where it applies,
how it rounds (int8 or int16 per 32), and the error bound that rounding implies."""

from __future__ import annotations

import torch

from worker_svc.model_loader.quant_format import QuantizedWeight
from worker_svc.models.quant_linear import _ops

BLOCK = 32  # activations are quantized per 32 elements
LEVELS = {8: 127, 16: 32767}  # activation bits -> the largest code (d = max|x| / LEVELS)


def activation_bits(weight: QuantizedWeight, m: int, act: int = 0) -> int:
    """The bits the op rounds activations to for this call (act 0: the process default), or 32
    where it keeps them fp32: no VNNI kernel on, not 8-bit codes, not decode rows (M <= 32), K not
    a multiple of 32, groups neither 16 nor a multiple of 32, or a call / default asking for fp32.
    Rows interleaved by 16, and packed 4-bit (groups of 32), 5- and 6-bit codes, take int16 on the
    AVX512-VNNI kernel only, when int16 is the process default."""
    ops = _ops()
    mode, _, default = ops.quant_int8_dot() if ops is not None and hasattr(ops, "quant_int8_dot") else (0, 0, 32)
    k, group = weight.shape[1], weight.group
    if m > 32:  # prefill rows: the int16 GEMM (cpu_quant_gemm16.cpp) on AVX512-VNNI, any storage, unless fp32 asked
        fits = k % BLOCK == 0 and (group == 16 or group % BLOCK == 0)
        return 16 if mode == 1 and (act or default) != 32 and fits else 32
    if weight.interleaved:  # only the AVX512-VNNI int16 kernel reads them; every other call widens rows
        return 16 if mode == 1 and m <= 32 and (act or default) == 16 else 32
    if weight.bits in (4, 5, 6):  # packed codes: the AVX512-VNNI kernel, int16 by default only
        fits = group == BLOCK if weight.bits == 4 else group == 16 or group % BLOCK == 0
        by_call = weight.bits != 4 or act in (0, 16)  # 5 / 6 bits have no per-call choice
        return 16 if mode == 1 and default == 16 and by_call and fits and m <= 32 and k % BLOCK == 0 else 32
    applies = bool(mode) and weight.bits == 8 and m <= 32 and k % BLOCK == 0 and (group % BLOCK == 0 or group == 16)
    return (act or default) if applies else 32


def quantized_activations(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """x [M, K] -> the values the op multiplies, in float64: per block of 32, d = max|x| / 127
    (int8) or / 32767 (int16) and round-half-even(x / d) * d, computed in fp32 as the op computes them."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / LEVELS[bits]
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).clamp(-LEVELS[bits], LEVELS[bits])
    return (q.double() * d.double()).reshape(m, k)


def activation_rounding_bound(x: torch.Tensor, w: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """[M, N] bound on |x W^T - x_q W^T| from rounding x per 32: each element moves by at most half
    a step, max|x| / (2 * LEVELS) of its block, so the error is <= sum_b half_step_b sum_{k in b} |w_k|
    (0 for bits 32: nothing rounded)."""
    m, k = x.shape
    if bits == 32:
        return torch.zeros(m, w.shape[0], dtype=torch.float64)
    half_step = x.double().abs().reshape(m, k // BLOCK, BLOCK).amax(-1) / (2 * LEVELS[bits])  # [M, K/32]
    w_abs = w.double().abs().reshape(w.shape[0], k // BLOCK, BLOCK).sum(-1)  # [N, K/32]
    return half_step @ w_abs.T * (1 + 1e-6)


def assert_within_summation_bound(out: torch.Tensor, xq: torch.Tensor, weight: QuantizedWeight,
                                  bias: torch.Tensor) -> None:
    """out against dequantise-then-matmul on the activations the op multiplies (xq, float64): the
    integer sums are exact, so only fp32 scaling and summation over K / 32 blocks are left, within
    1e-5 of sum |xq w| (and bf16 output's own rounding, 2^-8 of the value)."""
    w = weight.dequantize().double()
    ref = xq @ w.T + bias.double()
    bound = 1e-5 * (xq.abs() @ w.abs().T) + 1e-30
    if out.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
