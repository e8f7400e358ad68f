"""Gemma 2 and Gemma 3 (text-only): the Llama decoder with Gemma's norms, GeGLU and soft-capping.

- Embeddings times sqrt(hidden_size), rounded to the model dtype first (HF's normalizer tensor).
- Gemma RMSNorm scales by (1 + weight), in fp32, and casts after (Llama casts first).
- Four norms per block: input_layernorm and post_attention_layernorm around attention,
  pre_feedforward_layernorm and post_feedforward_layernorm around the MLP (the post-norms act on
  the block's output, before the residual add).
- GeGLU MLP (gelu_pytorch_tanh); attention scale query_pre_attn_scalar ** -0.5 (ModelConfig's
  attention_multiplier).
- Gemma 2 soft-caps the attention scores (attn_logit_softcapping, inside the backend) and both
  soft-cap the logits (final_logit_softcapping): C * tanh(x / C).
- Local (sliding-window) and global layers interleave (ModelConfig.layer_windows); Gemma 3's local
  layers turn RoPE at rope_local_base_freq, its global ones at rope_theta (+ rope_scaling), and it
  norms q and k per head (Gemma RMSNorm) before RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.models.common import AttentionMetadata, RMSNorm, RotaryEmbedding
from worker_svc.models.llama import MLP, Attention, LlamaForCausalLM, row_parallel
from worker_svc.parallel.distributed import SINGLE, TensorParallel


class GemmaRMSNorm(RMSNorm):
    """HF stores the weight as an offset from 1 (initialised to zeros)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> the same
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_idx: int = 0) -> None:
        super().__init__(cfg, tp, layer_idx)  # it hands Gemma 2's attn_logit_softcapping to the backend
        if cfg.qk_norm:  # Gemma 3: per head, like Qwen3's but Gemma's norm
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I/N] each
        return row_parallel(self.down_proj, nn.functional.gelu(gate, approximate="tanh") * up, self.tp)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_idx: int = 0) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, tp, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        h = self.self_attn(self.input_layernorm(x), positions, rotary, attn, kv_cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer
    final_norm = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, tp)
        # Gemma 3's local layers: plain RoPE at their own base (the loader rebuilds every cache).
        self.model.rotary_local = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta, None, cfg.rotary_dim)

    def layer_rotary(self, layer_idx: int) -> RotaryEmbedding:
        local = self.model.rotary_local is not None and self.config.layer_window(layer_idx) is not None
        return self.model.rotary_local if local else self.model.rotary

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # rounded as HF rounds it

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] float32; capped in the model dtype, as HF does
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
