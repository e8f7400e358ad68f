"""Tiny GGUF files for the tests, written with gguf.GGUFWriter the way llama.cpp's converter lays
them out (its tensor names and q/k row permutation, its stacked experts), independently of
worker_svc/model_loader/gguf_loader.py."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

from tests.worker.hf_models import build_hf_model
from worker_svc.model_loader.model_config import ModelConfig

Q = gguf.GGMLQuantizationType
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
               "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}  # MoE routers
# OLMo 2's post-norms: llama.cpp's olmo2 has no ffn_norm, its post_attention_layernorm is a post-norm.
OLMO2_NAMES = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# HF's per-expert projections (Mixtral's w1/w3/w2 too) -> the stacked GGUF tensor of that layer.
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# hf_models kind -> GGUF arch. Mistral and Mixtral are "llama" (Mixtral with llama.expert_count).
GGUF_ARCH = {"mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "olmo2": "olmo2",
             "granite": "granite", "mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
PERMUTED = ("llama", "granite")  # convert_hf_to_gguf.py's LlamaModel and its subclass GraniteModel


def gguf_name(hf: str, arch: str = "llama") -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)
    names = {**LAYER_NAMES, **OLMO2_NAMES} if arch == "olmo2" else LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's per-expert projections -> one [experts, rows, cols] array per projection, under
    its GGUF name (the converter's torch.stack); every other tensor stays, under its HF name."""
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    rest = {}
    for name, array in tensors.items():
        match = EXPERT.fullmatch(name)
        if match:
            stacks[match[1], EXPERT_NAMES[match[3]]][int(match[2])] = array
        else:
            rest[name] = array
    for (layer, stacked), experts in stacks.items():
        rest[f"blk.{layer}.{stacked}.weight"] = np.stack([experts[e] for e in range(len(experts))])
    return rest


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: what the loader must undo
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(writer: gguf.GGUFWriter, cfg: ModelConfig, arch: str) -> None:
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_ids[0])
    if arch == "phi3":  # Phi3MiniModel writes it always: int(partial_rotary_factor * hidden) // heads
        writer.add_rope_dimension_count(cfg.rotary_dim)
    if arch == "granite":  # GraniteModel: HF's multipliers, under llama.cpp's names
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":  # its feed_forward_length is the dense MLP's; Mixtral's and OLMoE's the experts'
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp stores it ("gpt2" model)."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(vocab))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token")))
    writer.add_chat_template(tok_config["chat_template"])


def gguf_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of `type_name` for a [rows, cols] tensor: gguf's quantizer where it has one
    (Q8_0, Q4_0, Q4_1), else random integers under small fp16 super-scales (the K-quants)."""
    rng = np.random.default_rng(seed)
    qtype = Q[type_name]
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        return gguf.quants.quantize(rng.normal(0, 0.05, (rows, cols)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), np.uint8)
    scale = rng.uniform(1e-4, 1e-3, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":  # d is the last field
        raw[:, -2:] = scale
    else:  # d, dmin lead
        raw[:, 0:2] = scale
        raw[:, 2:4] = rng.uniform(1e-4, 1e-3, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, model_dir: Path, arch: str, types: dict[str, Q] | None = None,
               tokenizer: bool = False) -> Path:
    """The HF directory `model_dir` (config + safetensors) as a GGUF for `arch`; tensors in F32
    unless `types` names another type for them (stacked experts: by their GGUF name). gguf cannot
    quantize to K-quants or IQ types: a tensor typed so gets random valid blocks instead."""
    cfg = ModelConfig.from_dir(model_dir)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg, arch)
    pad = json.loads((model_dir / "config.json").read_text()).get("pad_token_id")
    if pad is not None:  # the converter's SpecialVocab takes it from config.json
        writer.add_pad_token_id(pad)
    if tokenizer:
        _write_tokenizer(writer, model_dir)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v.numpy() for k, v in load_file(file).items()})
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name, array in stack_experts(tensors).items():
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = llama_cpp_permute(array, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        qtype = (types or {}).get(name, Q.F32)
        data = (array if qtype == Q.F32 else gguf_blocks(qtype.name, *array.shape, seed=len(name))
                if qtype.name.endswith("_K") or qtype.name.startswith("IQ") else gguf.quants.quantize(array, qtype))
        writer.add_tensor(name if name.startswith("blk.") else gguf_name(name, arch), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_to_gguf(kind: str, tmp_path: Path, types: dict[str, Q] | None = None) -> tuple[Path, Path]:
    """(HF directory, the same weights as a GGUF file) for one hf_models architecture."""
    hf_dir = build_hf_model(kind, tmp_path / kind)
    return hf_dir, write_gguf(tmp_path / f"{kind}.gguf", hf_dir, GGUF_ARCH[kind], types)
