"""Llama-family decoder over flat batches: Llama, Mistral, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm),
Phi-3 (partial rotary; its checkpoints come pre-fused), Granite (embedding, residual, attention and
logits scalings); OLMo 2 (worker_svc/models/olmo2.py) and Gemma 2 / 3 (worker_svc/models/gemma.py)
swap in their own decoder layers, and the
mixture-of-experts families (worker_svc/models/moe.py) their own MLP.

Plain eager PyTorch over `[num_tokens, hidden]`, no padding; q/k/v and gate/up are fused projections
(the loader fuses HF's separate weights). Attention goes only through the paged-KV backend.

Tensor parallelism (Megatron style, `tp.size` ranks): qkv_proj and gate_up_proj are column-parallel
(each rank holds Hq/N query heads, Hkv/N KV heads and I/N MLP columns), o_proj and down_proj are
row-parallel (partial products summed by one all-reduce each). The hidden state is replicated after
every all-reduce; embedding, norms and lm_head are replicated. With tp.size == 1 no collective runs.

Pipeline parallelism (worker_svc/parallel/pipeline.py): `keep_stage` drops, while the model is still on the
meta device, the layers other stages hold (a `MissingLayer` keeps each one's place, so parameter
names stay the checkpoint's `model.layers.N`), the embedding off the first stage (unless a tied LM
head needs it) and the final norm and LM head off all but the last. A later stage's forward takes
the previous stage's hidden states instead of token ids and returns its own, un-normed.

Usage (one prefill step of a 5-token prompt into blocks 3 and 7 of a block_size-16 cache):

    model, cfg = load_model("models/pagoda-tiny", torch.float32, torch.device("cpu"))
    shape = (num_blocks, 16, cfg.num_kv_heads, cfg.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    ids = torch.tensor([0, 20, 30, 40, 50]); pos = torch.arange(5)
    attn = AttentionMetadata(slot_mapping=3 * 16 + pos, block_tables=torch.tensor([[3, 7]], dtype=torch.int32),
                             seq_lens=torch.tensor([5], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                             max_query_len=5, max_seq_len=5, backend=get_backend("torch"))
    hidden = model(ids, pos, attn, kv_caches)              # [5, hidden]
    next_id = model.compute_logits(hidden[-1:]).argmax(-1)  # [1] from fp32 logits [1, vocab]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.models.common import AttentionMetadata, RMSNorm, RotaryEmbedding, silu_and_mul
from worker_svc.parallel.distributed import SINGLE, TensorParallel
from worker_svc.parallel.pipeline import SINGLE_STAGE, PipelineStage


def row_parallel(linear: nn.Module, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    # x: [T, in/N] -> [T, out]; the bias (replicated) is added once, after the sum over ranks.
    if tp.size == 1:
        return linear(x)
    # A LoRA-wrapped projection (worker_svc/lora/) adds its partial delta before the sum.
    partial = getattr(linear, "partial_product", None)
    out = tp.all_reduce(partial(x) if partial is not None else nn.functional.linear(x, linear.weight))
    return out if linear.bias is None else out + linear.bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_idx: int = 0) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim  # this rank's heads
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_multiplier or cfg.head_dim**-0.5  # Granite sets its own
        self.sliding_window = cfg.layer_window(layer_idx)  # None: full attention
        self.logits_soft_cap = cfg.attn_logit_softcapping  # Gemma 2; None: scores uncapped
        # rows: [q (Hq/N*D) | k (Hkv/N*D) | v (Hkv/N*D)]
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = rotary(positions, *self.norm_qk(q, k))
        k_cache, v_cache = kv_cache
        attn.backend.write_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping)
        out = attn.backend.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                           attn.query_start_loc, self.scale, attn.max_query_len,
                                           attn.max_seq_len, self.sliding_window,
                                           logits_soft_cap=self.logits_soft_cap)  # [T, Hq, D]
        return row_parallel(self.o_proj, out.reshape(num_tokens, self.q_size), self.tp)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D] (this rank's heads) -> the same; Qwen3 norms each head
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        inter = cfg.intermediate_size // tp.size  # this rank's columns
        # rows: [gate (I/N) | up (I/N)]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return row_parallel(self.down_proj, silu_and_mul(self.gate_up_proj(x)), self.tp)


class DecoderLayer(nn.Module):
    """Pre-norm block. A family that only swaps the attention or the MLP (the MoE families,
    worker_svc/models/moe.py) overrides `attention` or `make_mlp`."""

    attention: type[nn.Module] = Attention

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention(cfg, tp, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, tp, layer_idx)
        self.residual_multiplier = cfg.residual_multiplier  # Granite; 1.0 (skipped) elsewhere

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        x = x + self._scaled(self.self_attn(self.input_layernorm(x), positions, rotary, attn, kv_cache))
        return x + self._scaled(self.mlp(self.post_attention_layernorm(x)))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

    def make_mlp(self, cfg: ModelConfig, tp: TensorParallel, layer_idx: int) -> nn.Module:
        return MLP(cfg, tp)


class MissingLayer(nn.Identity):
    """The place of a layer another pipeline stage holds (no parameters, never called)."""


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE,
                 layer: type[nn.Module] = DecoderLayer, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, tp, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, cfg.rotary_dim)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF's (`model.layers.N....`, `lm_head`), except the fused
    `qkv_proj` and `gate_up_proj`. A family with other layers subclasses and names its own."""

    decoder_layer: type[nn.Module] = DecoderLayer
    final_norm: type[nn.Module] = RMSNorm
    # Set by the worker where the whole stack runs as one compiled op, on every step
    # (worker_svc/models/fused_decode.py): callable(x, positions, attn, kv_caches) -> hidden.
    fused_decode: Any = None

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.stage = SINGLE_STAGE
        self.model = LlamaModel(cfg, tp, self.decoder_layer, self.final_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def keep_stage(self, stage: PipelineStage) -> None:
        """Keep only what pipeline stage `stage` computes (on meta, before the weights load)."""
        self.stage = stage
        if stage.size == 1:
            return
        layers = self.model.layers
        for i in range(len(layers)):
            if not stage.holds_layer(i):
                layers[i] = MissingLayer()
        if not stage.is_first and not (stage.is_last and self.config.tie_word_embeddings):
            self.model.embed_tokens = None
        if not stage.is_last:
            self.model.norm = None
            self.lm_head = None

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage's modules."""
        if name.startswith("model.layers."):
            return self.stage.holds_layer(int(name.split(".")[2]))
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith("model.norm."):
            return self.model.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the checkpoint ties them (call again after
        anything that re-creates parameters, e.g. `to_empty`)."""
        # (a quantized lm_head, worker_svc/models/quant_linear.py, shares its rows with the embedding
        # the other way round: QuantEmbedding reads them)
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids, positions: [T] int64; kv_caches[i] = (k, v) [num_blocks, BS, Hkv, D] of this
        # stage's i-th layer; hidden: [T, hidden] from the previous pipeline stage (None on the
        # first) -> final-normed hidden states [T, hidden] (un-normed before the last stage)
        x = self.embed(input_ids) if hidden is None else hidden  # [T, hidden]
        if self.fused_decode is not None:
            return self.fused_decode(x, positions, attn, kv_caches)
        layers = self.model.layers
        for i, kv_cache in zip(self.stage.layers(len(layers)), kv_caches, strict=True):
            x = layers[i](x, positions, self.layer_rotary(i), attn, kv_cache)
        return x if self.model.norm is None else self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite
            x = x * self.config.embedding_multiplier
        return x

    def layer_rotary(self, layer_idx: int) -> RotaryEmbedding:
        return self.model.rotary

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] float32
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite: divided in the model dtype, as HF does
            logits = logits / self.config.logits_scaling
        return logits.float()
