"""The fused decode path: a pure-decode step of a plain Llama-family model as one compiled op.

Why (issue 35, one request at a time): at batch 1 the matmuls of SmolLM2's 30 layers take ~10 ms,
and the Python module loop around them (RMSNorm, RoPE, split/view, silu, residual adds: ~50 aten
ops and ~15 module calls per layer) took about as long again. `pagoda_cpu::decode_stack`
(kernels/decode/cpu_decode_stack.cpp) runs every layer (a pipeline stage's: worker_svc/parallel/pipeline.py)
and the final norm (on the last stage) in C++, through the
same linear and attention functions as the module path; the embedding and the logits stay here.

`fused_decode_for` decides once, after loading / packing, whether the model qualifies and then
collects the per-layer weights into the flat lists the op takes; `LlamaForCausalLM.forward` then
calls the result on EVERY step, prefills included. `PAGODA_FUSED_DECODE=0` keeps the module loop
on every step (to measure before/after, and for the tests that compare the two).

Why every step (issue 32, docs/reliability.md "Faults during the soak"): a token's logits must not
depend on the step it was computed in. The op computes each row by itself (plain loops per row,
the row-invariant packed linears and paged attention), so a row's bits are the same whatever the
other rows of the step; the module loop's element-wise aten ops are not (torch splits them across
threads by element count, and the row that holds a split point is computed partly by the scalar
tail: ~1 ulp), and they differ from the op's loops in the last bits anyway. With large prefills on
the module loop and decode steps on the op, a failover continuation (prompt + streamed tokens
prefilled in one chunk) or a prompt prefilled beside others got logits ~1e-6 off the undisturbed
stream's, and greedy decoding flipped on a near-tie (request 4,098 of the 10k fault soak: gap 6e-7).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from worker_svc.models.common import AttentionMetadata, RMSNorm, RotaryEmbedding
from worker_svc.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, MissingLayer
from worker_svc.models.packed_linear import PackedLinear
from worker_svc.models.quant_linear import QuantLinear
from worker_svc.models.row_buckets import RowBucketedLinear, bucket_rows

ENV_SWITCH = "PAGODA_FUSED_DECODE"
KIND_PACKED, KIND_QUANT, KIND_DENSE = 0, 1, 2  # the op's linear kinds (cpu_decode_stack.cpp)


@dataclass(frozen=True, slots=True)
class Setting:
    """What the worker runs the model with, beyond the model itself."""

    device: torch.device
    dtype: torch.dtype
    cache_dtype: torch.dtype
    attention_backend: str
    tensor_parallel_size: int = 1
    lora: bool = False
    batch_invariant: bool = False


def _linear(module: nn.Module) -> tuple[list, bool] | None:
    """(weight, scales, mins, bias, [kind, group, bits, zero]), bucketed -- or None if the op has
    no path for this module (a LoRA wrapper, the batch-invariant linear...)."""
    if type(module) is RowBucketedLinear and type(module.linear) is PackedLinear:
        inner = module.linear
        return [inner.weight, None, None, inner.bias, [KIND_PACKED, 0, 0, 0]], True
    if type(module) is PackedLinear:
        return [module.weight, None, None, module.bias, [KIND_PACKED, 0, 0, 0]], False
    if type(module) is QuantLinear and module.weight_q is not None:
        w = module.weight_q
        return [w.qweight, w.scales, w.mins, module.bias, [KIND_QUANT, w.group, w.bits, w.zero]], False
    if type(module) is nn.Linear:
        return [module.weight, None, None, module.bias, [KIND_DENSE, 0, 0, 0]], False
    return None


def _refusal(model: nn.Module, s: Setting) -> str | None:
    """Why the op cannot run this model as the module loop would, or None."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if s.device.type != "cpu" or s.attention_backend != "cpu":
        return "needs the CPU worker with the compiled attention backend"
    if s.tensor_parallel_size != 1 or s.lora or s.batch_invariant:
        return "tensor parallelism, LoRA and --batch-invariant keep the module loop"
    if s.dtype not in (torch.float32, torch.bfloat16) or s.cache_dtype != s.dtype:
        return "needs fp32 or bf16 activations and a KV cache of the same dtype"
    if not isinstance(model, LlamaForCausalLM) or any(
            getattr(type(model), name) is not getattr(LlamaForCausalLM, name)
            for name in ("forward", "embed", "layer_rotary")):  # Gemma scales its embedding, turns its own RoPE
        return f"{type(model).__name__} is not the plain Llama decoder"
    cfg = model.config
    if cfg.qk_norm or cfg.attn_logit_softcapping is not None or cfg.residual_multiplier != 1.0 \
            or cfg.rotary_dim != cfg.head_dim:
        return "q/k norms, logit soft-capping, residual scaling and partial rotary keep the module loop"
    if any(cfg.layer_window(i) is not None for i in range(cfg.num_layers)):
        return "sliding-window layers keep the module loop"
    inner = model.model
    if type(inner.norm) not in (RMSNorm, type(None)) or type(inner.rotary) is not RotaryEmbedding:
        return "needs the plain RMSNorm and RoPE"
    for layer in held_layers(model):
        if (type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention
                or type(layer.mlp) is not MLP or type(layer.input_layernorm) is not RMSNorm
                or type(layer.post_attention_layernorm) is not RMSNorm):
            return f"layer {type(layer).__name__} is not the plain Llama decoder layer"
    return None


def held_layers(model: LlamaForCausalLM) -> list[nn.Module]:
    """The decoder layers this rank computes: all, or its pipeline stage's."""
    return [layer for layer in model.model.layers if not isinstance(layer, MissingLayer)]


class FusedDecode:
    """`forward` of LlamaForCausalLM after the embedding, for any step: x [T, hidden]
    -> final-normed hidden [T, hidden]. Holds the flat weight lists the op reads. The op's
    attention is the compiled paged attention with its causal mask, so a sequence may bring
    several query rows."""

    def __init__(self, model: LlamaForCausalLM, ops: object, linears: list[list], bucketed: bool) -> None:
        inner, cfg = model.model, model.config
        self.ops, self.rotary, self.bucketed = ops, inner.rotary, bucketed
        layers = held_layers(model)
        # A pipeline stage before the last has no final norm: the op then returns the residual stream.
        self.norms = [n.weight.detach() for layer in layers
                      for n in (layer.input_layernorm, layer.post_attention_layernorm)
                      ] + ([] if inner.norm is None else [inner.norm.weight.detach()])
        self.weights = [entry[0].detach() for entry in linears]  # nn.Linear's: a Parameter
        self.scales = [entry[1] for entry in linears]
        self.mins = [entry[2] for entry in linears]
        self.biases = [None if entry[3] is None else entry[3].detach() for entry in linears]
        self.meta = [value for entry in linears for value in entry[4]]
        first = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scale, self.eps = first.scale, cfg.rms_norm_eps
        self._caches: tuple[list, list, list] | None = None  # (kv_caches, ks, vs): split once per cache

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # x: [T, hidden] (embedded); positions: [T] int64 -> [T, hidden]
        memo = self._caches
        if memo is None or memo[0] is not kv_caches:
            memo = self._caches = (kv_caches, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        rows = x.shape[0]
        return self.ops.decode_stack(
            x, positions, self.rotary.cos_sin_cache, self.norms, self.weights, self.scales, self.mins,
            self.biases, self.meta, memo[1], memo[2], attn.slot_mapping, attn.block_tables, attn.seq_lens,
            attn.query_start_loc, self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.eps,
            bucket_rows(rows) if self.bucketed else rows)


def fused_decode_for(model: nn.Module, setting: Setting) -> tuple[FusedDecode | None, str]:
    """The fused path for `model` as the worker runs it, or None and the reason it keeps the loop."""
    why = _refusal(model, setting)
    if why is not None:
        return None, why
    from kernels.cpu_extension import load, toolchain_available

    if not toolchain_available():
        return None, "no C++ toolchain for the compiled ops"
    linears, bucketed = [], set()
    for layer in held_layers(model):
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            entry = _linear(module)
            if entry is None:
                return None, f"no fused path for a {type(module).__name__} projection"
            linears.append(entry[0])
            if entry[0][4][0] == KIND_PACKED:
                bucketed.add(entry[1])
    if len(bucketed) > 1:  # one padded row count serves every packed linear of the step
        return None, "packed linears with and without row buckets"
    ops = load()
    if not hasattr(ops, "decode_stack"):  # a library built before kernels/decode/ existed
        return None, "the compiled library has no decode_stack: rebuild it (python -m kernels.cpu_extension)"
    return FusedDecode(model, ops, linears, bucketed == {True}), "on"
