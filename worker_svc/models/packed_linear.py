"""CPU linear layers whose weights are re-laid out once, at load, in oneDNN's blocked format.

Why: on CPU every decode step streams all the weights from DRAM (SmolLM2 in fp32: 540 MB per step,
far beyond the L3), so a decode step is a row of skinny GEMMs (M = the batch's token count) bound
by how well the BLAS streams its B operand. aten's `linear` hands the row-major [out, in] weight
to MKL, which on the machines measured (AMD EPYC, AVX-512) ran a 16-row GEMM at ~95 GFLOP/s;
the same product through oneDNN with the weight pre-packed for its AVX-512 kernel ran at ~200, and
large prefill GEMMs at 1.2–1.4× too (benchmarks/linear_layouts.py prints the table). This is what
vLLM's CPU backend and inductor's CPU freezing pass do; `torch.ops.mkldnn` ships in every x86 torch
wheel, so it needs nothing more to install.

Exactness: oneDNN sums each dot product in its own order, so outputs differ from MKL's in the
last bits (~1e-7 relative), the same size of difference as MKL's own between batch shapes; the HF
parity tests (logits within 1e-4, token-identical greedy) run through this path.

The model code stays plain `nn.Linear`: `pack_linear_weights` swaps the modules after loading.
Tensor parallelism keeps plain weights (`row_parallel` multiplies by `linear.weight` itself).

Hardware: oneDNN packs fp32 on every x86-64 CPU, but its bf16 and fp16 kernels need instructions
not every CPU has (fp16: avx512_fp16 or avx_ne_convert, which AMD EPYC Zen 4 lacks; packing then
raises). `can_pack` asks oneDNN first, and the worker keeps plain `nn.Linear` where it says no.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# oneDNN's own answer to "does this CPU run the reduced-precision kernels" (fp32 always runs).
_ONEDNN_SUPPORT_PROBES = {torch.bfloat16: "_is_mkldnn_bf16_supported",
                          torch.float16: "_is_mkldnn_fp16_supported"}


def cpu_packs_dtype(dtype: torch.dtype) -> bool:
    probe = _ONEDNN_SUPPORT_PROBES.get(dtype)
    return probe is None or bool(getattr(torch.ops.mkldnn, probe)())


def can_pack(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and cpu_packs_dtype(dtype)


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight packed once by oneDNN. `weight` is that opaque packed
    tensor (same shape and dtype as the original, but no strided storage: only oneDNN reads it)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def replace_modules(model: nn.Module, kind: type[nn.Module], make: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every `kind` module of `model` by `make(module)` in its parent; returns how many.
    (The worker's linear swaps after loading: packing, batch invariance, row buckets.)"""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, kind)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(module))
    return len(targets)


def pack_linear_weights(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear`; returns how many were packed.
    A weight shared with an embedding (tied lm_head) is packed as a copy: the embedding keeps
    the row-major table it gathers from."""
    return replace_modules(model, nn.Linear, PackedLinear)
