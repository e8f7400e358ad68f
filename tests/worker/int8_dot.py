"""What the quantized linear's int8 dot-product path (kernels/linear/cpu_quant_int8dot.cpp) does to
activations, restated in torch for the tests: where it applies, how it rounds, and the error bound
that rounding implies."""

from __future__ import annotations

import torch

from worker_svc.model_loader.quant_format import QuantizedWeight
from worker_svc.models.quant_linear import _ops

BLOCK = 32  # activations are quantized per 32 elements


def int8_dot_applies(weight: QuantizedWeight, m: int) -> bool:
    """The op takes the int8 path: a VNNI kernel on, 8-bit codes, decode rows (M <= 32), K a
    multiple of 32 and groups of 16 or a multiple of 32."""
    ops = _ops()
    mode = ops.quant_int8_dot()[0] if ops is not None and hasattr(ops, "quant_int8_dot") else 0
    k, group = weight.shape[1], weight.group
    return bool(mode) and weight.bits == 8 and m <= 32 and k % BLOCK == 0 and (group % BLOCK == 0 or group == 16)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> the values the op multiplies, in float64: per block of 32, d = max|x| / 127 and
    round-half-even(x / d) * d, computed in fp32 exactly as the op computes them."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * d.double()).reshape(m, k)


def activation_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] bound on |x W^T - x_q W^T| from rounding x to int8: each element moves by at most
    half a step, max|x| / 254 of its block, so the error is <= sum_b (max_b |x| / 254) sum_{k in b} |w_k|."""
    m, k = x.shape
    half_step = x.double().abs().reshape(m, k // BLOCK, BLOCK).amax(-1) / 254  # [M, K/32]
    w_abs = w.double().abs().reshape(w.shape[0], k // BLOCK, BLOCK).sum(-1)  # [N, K/32]
    return half_step @ w_abs.T * (1 + 1e-6)
