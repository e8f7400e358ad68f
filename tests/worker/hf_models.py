"""Tiny random HF transformers checkpoints of each supported architecture, saved into a directory.

Every parameter is perturbed from HF's init (norm weights around 1, biases non-zero) so that a
wrong mapping of any tensor shows up in the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from kernels import default_backend_name, get_backend
from pagoda.runtime.math_utils import cdiv
from worker_svc.models.common import AttentionMetadata

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

PHI3_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# Gemma: head_dim 16 != query_pre_attn_scalar 24 (the attention scale); window 16, so prompts and
# outputs run past it on the local layers; caps low enough that the random weights' scores and
# logits reach them (a missing tanh moves the logits by far more than the tolerance).
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16, tie_word_embeddings=True)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
GRANITE_SCALES = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.1,
                  "logits_scaling": 8.0}


def _configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        # GQA 2, llama3 rope scaling, untied, saved in several shards
        "llama": transformers.LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
        "mistral": transformers.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None,
                                              rope_theta=1000.0),
        # QKV bias, tied embeddings
        "qwen2": transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=False),
        # sliding window of 16 tokens on every layer (prompts and outputs run well past it)
        "mistral_swa": transformers.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=16,
                                                  rope_theta=1000.0),
        # window 12 from layer 1 on (max_window_layers): layer 0 full, layers 1-2 windowed
        "qwen2_swa": transformers.Qwen2Config(**{**COMMON, "num_hidden_layers": 3}, tie_word_embeddings=True,
                                              use_sliding_window=True, sliding_window=12, max_window_layers=1),
        # q/k RMSNorm, head_dim (32) != hidden / heads (16), MHA-to-GQA ratio 4
        "qwen3": transformers.Qwen3Config(**{**COMMON, "num_attention_heads": 8}, head_dim=32,
                                          tie_word_embeddings=False, use_sliding_window=False),
        # checkpoint-fused qkv_proj / gate_up_proj, RoPE over half of each head (partial rotary)
        "phi3": transformers.Phi3Config(**COMMON, tie_word_embeddings=False, pad_token_id=0,
                                        rope_parameters=PHI3_ROPE),
        # post-norms, q/k RMSNorm over all heads at once
        "olmo2": transformers.Olmo2Config(**COMMON, tie_word_embeddings=False, pad_token_id=0),
        # embedding, residual, attention (0.1, not 16 ** -0.5) and logits scalings; tied embeddings
        "granite": transformers.GraniteConfig(**COMMON, tie_word_embeddings=True, **GRANITE_SCALES),
        # mixture of experts: 8 experts, top-2. Mixtral renormalises the top-k weights (always).
        "mixtral": transformers.MixtralConfig(**{**COMMON, "intermediate_size": 64}, tie_word_embeddings=False,
                                              num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
        # per-head q/k norms, renormalised top-k, experts narrower than the dense MLP of layer 1
        "qwen3_moe": transformers.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, tie_word_embeddings=False,
                                                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 norm_topk_prob=True, mlp_only_layers=[1],
                                                 use_sliding_window=False),
        # OLMo 2's whole-q/k norms, top-k weights not renormalised
        "olmoe": transformers.OlmoeConfig(**{**COMMON, "intermediate_size": 64}, tie_word_embeddings=False,
                                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                          pad_token_id=0),
        # local/global layers (window 16), attention and final logit soft-capping, GeGLU, 4 norms per block
        "gemma2": transformers.Gemma2Config(**COMMON, **GEMMA, attn_logit_softcapping=1.5,
                                            final_logit_softcapping=4.0),
        # per-head q/k Gemma norms; local layers' own RoPE base, global layers' linear-scaled RoPE
        "gemma3": transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3}, **GEMMA, final_logit_softcapping=4.0, rope_parameters=GEMMA3_ROPE,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    }


ARCHITECTURES = tuple(_configs())


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.1 * noise)
        else:
            param.copy_(0.08 * noise)


def build_hf_model(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """Save a tiny `kind` checkpoint (see ARCHITECTURES) into out_dir and return it."""
    config = _configs()[kind]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    shard = "60KB" if kind == "llama" else "100MB"
    model.save_pretrained(out_dir, max_shard_size=shard)
    return out_dir


def hf_logits(model_dir: Path, input_ids: list[int]) -> torch.Tensor:
    """HF's fp32 eager logits [len(input_ids), vocab] for one sequence."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([input_ids])).logits[0].float()


class PagedSequence:
    """One sequence over a shuffled block table, fed to the model chunk by chunk."""

    def __init__(self, model, cfg, max_len: int, seed: int, block_size: int = 8,
                 backend: str | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model = model
        # the worker's own default ("cpu" wherever it builds): parity must hold through it
        self.backend = get_backend(backend or default_backend_name(torch.device("cpu")))
        self.block_size = block_size
        num_needed = cdiv(max_len, block_size)
        num_blocks = 3 * num_needed  # a pool larger than needed, so the table is a real shuffle
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # NaN-poisoned: reading any slot that was not written would poison the logits.
        self.kv_caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                          for _ in range(cfg.num_layers)]
        self.table = torch.randperm(num_blocks, generator=gen)[:num_needed]
        self.num_computed = 0

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Run the next len(token_ids) tokens; return their logits [q_len, vocab]."""
        q_len = len(token_ids)
        positions = torch.arange(self.num_computed, self.num_computed + q_len)  # [q_len]
        bs = self.block_size
        slots = self.table[positions // bs] * bs + positions % bs  # [q_len]
        seq_len = self.num_computed + q_len
        attn = AttentionMetadata(
            slot_mapping=slots.long(),
            block_tables=self.table[None, :].to(torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
            max_query_len=q_len, max_seq_len=seq_len, backend=self.backend)
        with torch.no_grad():
            hidden = self.model(torch.tensor(token_ids), positions, attn, self.kv_caches)  # [q_len, H]
            logits = self.model.compute_logits(hidden)
        self.num_computed = seq_len
        assert logits.dtype == torch.float32 and logits.shape[0] == q_len
        return logits
