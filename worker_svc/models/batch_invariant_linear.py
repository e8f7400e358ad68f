"""bf16 linear layers whose every output row is independent of the batch shape (`--batch-invariant`).

oneDNN picks its kernel and blocking by the number of rows M, so in bf16 a token's logits move in the
last bits with how many rows share the step: a speculative verification pass (K+1 rows per sequence)
then disagrees now and then with plain decoding (1 row), and greedy outputs differ with speculation
on. `BatchInvariantLinear` runs the compiled op `pagoda_cpu::bi_linear`
(kernels/linear/cpu_bi_linear.cpp): each output element is one fixed sequence of fp32
accumulations over K whatever M is (AMX tiles where the CPU has them, a portable loop elsewhere).
fp32 needs none of this: its results already do not depend on M here (tests/worker/test_spec_decode_llm.py).

The cost is speed where oneDNN's own choice was faster (benchmarks/batch_invariant.py prints both).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_extension
from pagoda.runtime.math_utils import cdiv
from worker_svc.models.packed_linear import replace_modules

COLS, K_STEP = 16, 32  # one AMX B tile: 16 output columns x 32 K values (16 pairs)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N_pad/16, K_pad/32, 16 (k pairs), 16 (columns), 2] bf16, zero padded: the VNNI
    tiles the kernel loads, one 1 KiB tile per 16 columns and 32 K values."""
    n, k = weight.shape
    n_pad, k_pad = cdiv(n, COLS) * COLS, cdiv(k, K_STEP) * K_STEP
    padded = torch.zeros(n_pad, k_pad, dtype=torch.bfloat16)
    padded[:n, :k] = weight.detach().to(torch.bfloat16)
    tiles = padded.view(n_pad // COLS, COLS, k_pad // K_STEP, K_STEP // 2, 2)  # [nb, col, kb, pair, 2]
    return tiles.permute(0, 2, 3, 1, 4).contiguous()  # [nb, kb, pair, col, 2]


class BatchInvariantLinear(nn.Module):
    """`nn.Linear` (bf16) computed by `pagoda_cpu::bi_linear`. A bias is added after the op's
    rounding to bf16, as a plain elementwise op: still batch-invariant, one rounding more than an
    fp32 add inside the kernel would make."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self._ops = cpu_extension.load()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] bf16 -> [..., out] bf16
        flat = x.reshape(-1, self.in_features)
        out = self._ops.bi_linear(flat.contiguous(), self.packed, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, batch_invariant=True"


def uses_amx() -> bool:
    return bool(cpu_extension.load().bi_linear_uses_amx())


def make_linears_batch_invariant(model: nn.Module) -> int:
    """Replace every bf16 `nn.Linear` in `model` by a `BatchInvariantLinear`; returns how many.
    A weight tied to an embedding is packed as a copy (the embedding keeps its row-major table)."""
    return replace_modules(model, nn.Linear, BatchInvariantLinear)
