"""Building blocks shared by the decoder models: attention metadata, RMSNorm, RoPE, SiLU-and-mul.

All math mirrors HF transformers' Llama family so fp32 logits match it to ~1e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import AttentionBackend


@dataclass(slots=True)
class AttentionMetadata:
    """One step's flat-batch view of the paged KV cache (the same for every layer)."""

    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V goes; -1 = do not write
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [S + 1] int32: sequence i owns rows [qsl[i], qsl[i+1])
    max_query_len: int
    max_seq_len: int
    backend: AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]; the statistics are taken in fp32 whatever the weights' dtype (as HF does).
        # An fp32 x skips the two casts (no-ops, but each a dispatcher call, twice per layer).
        if x.dtype == torch.float32:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * I] (gate first, then up) -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in fp32, computed exactly as HF does."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between smoothed.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE over a precomputed cos/sin cache indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, rotary_dim: int | None = None) -> None:
        super().__init__()
        # Partial rotary (Phi-3 family): only the first rotary_dim of each head's dims turn.
        self.rotary_dim = rotary_dim or head_dim
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        # Not persistent: rebuilt from the config, never loaded. Kept in the model dtype (HF casts
        # its fp32 cos/sin to the activation dtype before use, so this is the same rounding).
        # Built on meta (the loader's construction), it is only a shape: the loader calls reset_cache
        # once the model is materialised, and the math on meta tensors would import torch._dynamo.
        on_meta = torch.empty(0).device.type == "meta"
        cache = torch.empty(max_positions, 2 * self.rotary_dim) if on_meta else self._build_cache()
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._memo: tuple | None = None  # (positions, dtype, cos, sin) of the last forward

    def _build_cache(self, device: torch.device | None = None) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling).to(device)  # [R/2]
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
        return torch.cat((emb.cos(), emb.sin()), dim=-1)  # [P, 2R]

    def reset_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        """Recompute after the module was materialised from the meta device."""
        self.cos_sin_cache = self._build_cache(device).to(dtype)
        self._memo = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D] -> the same shapes
        cos, sin = self._cos_sin(positions, q.dtype)  # [T, 1, R] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered once per forward, not once per layer: every layer passes the same positions
        tensor (at batch 1 the gather and its casts were ~5 of each layer's small ops). The memo
        holds that tensor, so its id cannot be reused by the next step's; a caller never changes
        positions in place during a forward (inference tensors have no version counter to check)."""
        memo = self._memo
        if memo is None or memo[0] is not positions or memo[1] != dtype:
            cos, sin = self.cos_sin_cache[positions].to(dtype).chunk(2, dim=-1)  # [T, R] each
            memo = self._memo = (positions, dtype, cos[:, None, :], sin[:, None, :])  # [T, 1, R]
        return memo[2], memo[3]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, R] with R <= D: dims past R pass through unturned
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, passed), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
