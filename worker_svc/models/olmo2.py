"""OLMo 2: the Llama decoder with its norms moved and widened.

- Post-norms: each block's output is normed before the residual add (`x + norm(attn(x))`), and the
  block's input is not (no input_layernorm): `post_attention_layernorm`, `post_feedforward_layernorm`.
- q_norm / k_norm are RMSNorms over the whole projected q and k (all heads, Hq*D and Hkv*D), not
  per head as Qwen3's. Under tensor parallelism each rank holds only its heads, so the statistics
  are summed over ranks (one small all-reduce each) and each rank applies its slice of the
  replicated weight.
- OLMo 2's RMSNorm multiplies by the weight in fp32 and casts after (Llama casts first); the same
  in fp32, and matching HF's rounding in bf16/fp16.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.models.common import AttentionMetadata, RMSNorm, RotaryEmbedding
from worker_svc.models.llama import MLP, Attention, LlamaForCausalLM
from worker_svc.parallel.distributed import SINGLE, TensorParallel


class Olmo2RMSNorm(RMSNorm):
    """RMSNorm over `dim` features, of which each of the `tp.size` ranks holds a contiguous
    1/tp.size slice (the whole of them without TP). OLMoE's norms are the same but cast before
    multiplying by the weight (Llama's order): `weight_in_fp32 = False`."""

    weight_in_fp32 = True

    def __init__(self, dim: int, eps: float, tp: TensorParallel = SINGLE) -> None:
        super().__init__(dim, eps)  # the whole weight, on every rank
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim / tp.size] -> the same
        x32 = x.float()
        if self.tp.size == 1:
            weight, variance = self.weight, x32.pow(2).mean(-1, keepdim=True)
        else:
            width = x.shape[-1]
            weight = self.weight[self.tp.rank * width:(self.tp.rank + 1) * width]
            variance = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.weight.shape[0]
        normed = x32 * torch.rsqrt(variance + self.eps)
        if self.weight_in_fp32:
            return (weight * normed).to(x.dtype)
        return weight * normed.to(x.dtype)


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_idx: int = 0) -> None:
        super().__init__(cfg, tp, layer_idx)
        self.q_norm = Olmo2RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps, tp)
        self.k_norm = Olmo2RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps, tp)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D] -> the same, each normed over all its heads at once
        return self.q_norm(q.flatten(1)).view_as(q), self.k_norm(k.flatten(1)).view_as(k)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, tp, layer_idx)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, rotary, attn, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Olmo2DecoderLayer
    final_norm = Olmo2RMSNorm
