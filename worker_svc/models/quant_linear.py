"""Weight-only quantized linears on CPU: int8 or packed 6-, 5- and 4-bit codes never widened in memory.

Why: a batch-1 decode step streams every weight from DRAM once, so its time is the weight bytes
read per step. SmolLM2 in fp32 reads 4 bytes per weight; Q8_0 reads 1.06, Q4_K 0.56. The layer
keeps exactly what a GGUF stores (docs/quantization.md) and multiplies through the compiled op
`pagoda_cpu::quant_linear` (kernels/linear/cpu_quant_linear.cpp; the 5- and 6-bit codes of
Q5_0 / Q5_1 / Q5_K / Q6_K in cpu_quant_linear_lowbit.cpp).

One format (worker_svc/model_loader/quant_format.py) covers every GGUF type we serve, bit for
bit: the integers, and fp32 scales computed from the file's fp16 ones with the same operations as
gguf's numpy reference: w = scales * (q - zero) (+ mins), per group of 16 / 32 / K along a row.

The product and the sum are rounded separately (no FMA), as numpy does, so the dequantised weights
are bit-identical to `gguf.quants.dequantize`; tests/worker/test_quant_linear.py checks it.

What torch 2.13 ships for CPU, and why the compiled op (benchmarks/quant_linear.py prints the table):
`_weight_int8pack_mm` takes per-channel scales only (Q8_0's per-32 scales cannot go through it),
`_weight_int4pack_mm_for_cpu` takes per-group scale + zero as w = (q - 8) * scale + zero (Q4_0 and
Q4_1 fit, with bf16 scales: not bit-exact, and Q5_K / Q6_K do not), `_dyn_quant_matmul_4bit` quantizes
the activations too (a KleidiAI kernel for Arm; not measured here). Our op reads each format as stored.

Fused projections (qkv, gate_up) concatenate their parts along N: groups stay within a row, so this
is exact; parts of different formats (Q4_K_M stores some attn_v in Q6_K) are first widened to the
common one (int8 storage, the smallest group, mins where any part has them), also exactly.
Alike parts keep their packed format.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from worker_svc.model_loader.quant_format import QuantizedWeight, concat, quantize

# -- modules ----------------------------------------------------------------------------------------

@functools.cache
def _ops() -> object | None:
    """The compiled ops, or None where no toolchain can build them (then: dequantise per call)."""
    from kernels.cpu_extension import load, toolchain_available

    return load() if toolchain_available() else None


INT8_DOT_SWITCH = "PAGODA_INT8_DOT"  # "0" off, "8" / "16" that default precision (the op reads it once)
INT8_DOT_KERNELS = ("off", "avx512_vnni", "avx_vnni")  # the op's codes (kernels/linear/cpu_quant_int8dot.h)
ACT_BITS = (8, 16, 32)  # `act`: int8 / int16 activations on the integer path, or fp32 (the exact path)


def int8_dot_status() -> tuple[str, str]:
    """(kernel, why): which integer dot-product kernel 8-bit weights use at decode, and why that one.
    On a VNNI CPU the op quantizes the activations per 32 to int16 (the default) or int8."""
    ops = _ops()
    if ops is None or not hasattr(ops, "quant_int8_dot"):
        return "off", "no compiled ops (or a library built before the int8 path: rebuild it)"
    mode, best, act = ops.quant_int8_dot()
    if mode and act != 32:
        return INT8_DOT_KERNELS[mode], f"the CPU has it; int{act} activations by default ({INT8_DOT_SWITCH}=0|8|16)"
    if best:
        return "off", f"turned off ({INT8_DOT_SWITCH}=0): 8-bit weights widened to fp32"
    return "off", "the CPU has neither AVX512-VNNI nor AVX-VNNI: 8-bit weights widened to fp32"


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    """x [..., K] (fp32 / bf16) @ w.T -> [..., N] in x's dtype. `act`: the activations' precision
    on the integer dot-product path of 8-bit codes (ACT_BITS; 0 the process default)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    ops = _ops() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
    if ops is None:
        out = nn.functional.linear(x2.float(), w.dequantize(), None if bias is None else bias.float()).to(x.dtype)
    else:
        out = ops.quant_linear(x2, w.qweight, w.scales, w.mins, bias, w.group, w.bits, w.zero, act)
    return out.reshape(*lead, out.shape[-1])


class QuantLinear(nn.Module):
    """`nn.Linear`'s forward over a `QuantizedWeight` (buffers: qweight, scales, mins). Built empty
    by the loader and filled by row ranges (`load_rows`, the parts of a fused projection), or
    from a float `nn.Linear` (`from_linear`, --quantization)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.weight_q: QuantizedWeight | None = None
        self.act = 0  # activation bits on the integer dot-product path (ACT_BITS); 0: the process default
        self._parts: dict[int, QuantizedWeight] = {}

    @classmethod
    def from_linear(cls, linear: nn.Module, method: str) -> QuantLinear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None)
        module.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        module.set_weight(quantize(linear.weight, method))
        return module

    def set_weight(self, weight: QuantizedWeight) -> None:
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {weight.shape} != ({self.out_features}, {self.in_features})")
        self.weight_q = weight
        # buffers, so that state_dict / memory accounting see them (the dataclass holds the same tensors)
        self.register_buffer("qweight", weight.qweight, persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)
        self.register_buffer("mins", weight.mins, persistent=False)

    def load_rows(self, start: int, weight: QuantizedWeight) -> None:
        """Rows [start, start + weight.shape[0]) of a fused weight; complete once every row came."""
        self._parts[start] = weight
        if sum(p.shape[0] for p in self._parts.values()) == self.out_features:
            ordered = [self._parts[s] for s in sorted(self._parts)]
            self._parts = {}
            self.set_weight(concat(ordered))

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_q.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_matmul(x, self.weight_q, self.bias, self.act)

    def extra_repr(self) -> str:
        w = self.weight_q
        fmt = "empty" if w is None else f"int{w.bits}, group={w.group}, mins={w.mins is not None}" + (
            ", rows interleaved by 16" if w.interleaved else "")
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmt}"


class QuantEmbedding(nn.Module):
    """The token embedding read from the same quantized rows as a tied lm_head: each step widens
    only its tokens' rows (a few KB), where an fp32 table of SmolLM2 would hold 113 MB. An untied
    GGUF's own quantized token_embd (own=True: a QuantLinear of [vocab, hidden] that only this
    reads) likewise: Qwen2.5-0.5B's Q5_0 table was widened at load to 545 MB of fp32."""

    def __init__(self, lm_head: QuantLinear, dtype: torch.dtype, own: bool = False) -> None:
        super().__init__()
        if own:
            self.table = lm_head  # a submodule: its buffers are this model's (loaded, counted, moved)
        self.head = [lm_head]  # a list: a tied head's weights are not counted twice
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = lm_head.out_features, lm_head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden] in the model dtype
        return self.head[0].weight_q.rows(ids.reshape(-1)).dequantize().to(self.dtype).reshape(*ids.shape, -1)


def keep_half_scales(model: nn.Module) -> int:
    """Q8_0's scales (8-bit codes, groups of 32, no mins) back to the fp16 the file stores them in,
    wherever fp16 holds them exactly and the integer dot paths read them: a batch-1 decode step then
    reads 1.0625 bytes per weight as llama.cpp does instead of 1.125 (SmolLM2: ~8 of ~151 MB).
    The op's other paths (prefill rows, fp32 activations, a CPU without VNNI) widen an fp32 copy
    per call, so this is done only where an integer path is the default. Returns how many."""
    ops = _ops()
    if ops is None or not hasattr(ops, "quant_int8_dot"):
        return 0
    mode, _, act = ops.quant_int8_dot()
    if not mode or act not in (8, 16):
        return 0
    count = 0
    for module in model.modules():
        w = getattr(module, "weight_q", None) if isinstance(module, QuantLinear) else None
        if (w is None or module.act == 32 or (w.bits, w.group, w.mins) != (8, 32, None)
                or w.scales.dtype != torch.float32):
            continue
        half = w.scales.half()
        if torch.equal(half.float(), w.scales):  # --quantization int8's fp32 scales rarely are
            module.set_weight(QuantizedWeight(w.qweight, half, None, 8, 32, w.zero, w.in_features))
            count += 1
    return count


def interleaving_default() -> bool:
    """Whether the op's int16 AVX512-VNNI kernel is the default for 8-bit codes now: the one
    kernel that reads rows interleaved by 16 (interleave_rows)."""
    ops = _ops()
    if ops is None or not hasattr(ops, "quant_int8_dot"):
        return False
    mode, _, act = ops.quant_int8_dot()
    return INT8_DOT_KERNELS[mode] == "avx512_vnni" and act == 16


def interleave_rows(model: nn.Module) -> int:
    """8-bit codes in groups of 32 (Q8_0, --quantization int8) with rows interleaved by 16
    (QuantizedWeight.interleaved), where the op's int16 AVX512-VNNI kernel is the default: it
    reads them in one sequential pass with a third of the row-major kernel's instructions per
    weight (cold weights 12.6 -> 19 GB/s with 2 threads in docs/quantization.md's measurement).
    The same bytes; every other path of the op and every Python reader widens rows from the
    interleaved places. Returns how many."""
    if not interleaving_default():
        return 0
    count = 0
    for module in model.modules():
        w = getattr(module, "weight_q", None) if isinstance(module, QuantLinear) else None
        if w is None or module.act not in (0, 16) or not w.can_interleave or w.qweight.device.type != "cpu":
            continue
        module.set_weight(w.interleave_rows())
        count += 1
    return count


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace every dense `nn.Linear` of `model` (not the MoE router) by a `QuantLinear`; a tied
    lm_head also replaces the embedding by a `QuantEmbedding` over its rows. Returns how many."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.endswith("mlp.gate")]
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    embed_dtype = model.model.embed_tokens.weight.dtype if tied else None
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(module, method))
    if tied:
        model.model.embed_tokens = QuantEmbedding(model.lm_head, embed_dtype)
    return len(targets)
