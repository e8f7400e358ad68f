"""Mixture-of-experts families: Mixtral, Qwen3-MoE, OLMoE. The Llama decoder layer with its MLP
replaced by `MoEMLP` (on the layers the config makes sparse; Qwen3-MoE may keep dense ones).

MoEMLP: a replicated router `gate` [E, hidden] scores each token; softmax (fp32) then top-k picks
its num_experts_per_tok experts and their weights (renormalised to sum to 1 when the config says
so). The experts are SiLU-gated MLPs stored stacked: `experts.gate_up_proj` [E, 2 I, hidden]
(rows [gate | up], as HF transformers 5 stores them) and `experts.down_proj` [E, hidden, I].

No loop over tokens: the T*k (token, expert) assignments are sorted by expert, the routed rows
gathered once, and each expert with any tokens runs one dense matmul over all of them (at most E
iterations, 2 matmuls each); the weighted outputs are scattered back with one index_add.

Tensor parallelism: each rank holds I/N of every expert's gate/up rows and down columns (and of
a dense layer's, as the Llama MLP); the experts' partial outputs are weighted, combined, then
summed over ranks by one all-reduce, the same as the dense MLP's row-parallel down_proj.

Checkpoint names are HF's per-expert `mlp.experts.N.{gate,up,down}_proj.weight` (Mixtral's
`block_sparse_moe.experts.N.w1/w3/w2` are renamed to those by the loader).
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.models.common import silu_and_mul
from worker_svc.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from worker_svc.models.olmo2 import Olmo2Attention, Olmo2RMSNorm
from worker_svc.parallel.distributed import SINGLE, TensorParallel


def expert_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [n, in], weight: [out, in] -> [n, out]; one call per expert matmul (tests count them)
    return nn.functional.linear(x, weight)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # x: [n, hidden], rows grouped by expert (counts[e] rows for expert e, in order) -> [n, hidden]
        out = torch.empty_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            hidden = silu_and_mul(expert_linear(x[rows], self.gate_up_proj[expert]))  # [count, I]
            out[rows] = expert_linear(hidden, self.down_proj[expert])
            start += count
        return out


class MoEMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        # Mixtral multiplies the expert outputs by the fp32 weights; Qwen3-MoE and OLMoE cast the
        # weights to the model dtype first (the same in fp32; HF's rounding in bf16/fp16).
        self.fp32_weights = cfg.architecture == "MixtralForCausalLM"
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(x.dtype)
        order = chosen.flatten().argsort(stable=True)  # [T*k] assignments grouped by expert
        tokens = order // self.top_k  # [T*k] the token of each grouped assignment
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts).tolist()
        routed = self.experts(x[tokens], counts)  # [T*k, hidden]
        routed = (routed * weights.flatten()[order, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tokens, routed)  # [T, hidden]
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


class MoEDecoderLayer(DecoderLayer):
    """Mixtral's and Qwen3-MoE's layer (Qwen3's per-head q/k norms come with cfg.qk_norm)."""

    def make_mlp(self, cfg: ModelConfig, tp: TensorParallel, layer_idx: int) -> nn.Module:
        return MoEMLP(cfg, tp) if cfg.is_moe_layer(layer_idx) else MLP(cfg, tp)


class OlmoeRMSNorm(Olmo2RMSNorm):
    weight_in_fp32 = False


class OlmoeAttention(Olmo2Attention):
    """OLMo 2's q/k norms over all heads at once, in Llama's cast order."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_idx: int = 0) -> None:
        super().__init__(cfg, tp, layer_idx)
        self.q_norm = OlmoeRMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps, tp)
        self.k_norm = OlmoeRMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps, tp)


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention = OlmoeAttention


class MoEForCausalLM(LlamaForCausalLM):
    decoder_layer = MoEDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    decoder_layer = OlmoeDecoderLayer
