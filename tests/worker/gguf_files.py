"""Tiny GGUF files for the tests, written with gguf.GGUFWriter the way llama.cpp's converter lays
them out (its tensor names and q/k row permutation), independently of worker_svc/model_loader/gguf_loader.py."""

from __future__ import annotations

import json
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
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GGUF_ARCH = {"mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # hf_models kind -> GGUF arch


def gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: what the loader must undo
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(writer: gguf.GGUFWriter, cfg: ModelConfig) -> None:
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


def write_gguf(path: Path, model_dir: Path, arch: str, types: dict[str, Q] | None = None,
               tokenizer: bool = False) -> Path:
    """The HF directory `model_dir` (config + safetensors) as a GGUF for `arch`; tensors in F32
    unless `types` names another type for them."""
    cfg = ModelConfig.from_dir(model_dir)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg)
    if tokenizer:
        _write_tokenizer(writer, model_dir)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v.numpy() for k, v in load_file(file).items()})
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name, array in tensors.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = llama_cpp_permute(array, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        qtype = (types or {}).get(name, Q.F32)
        data = array if qtype == Q.F32 else gguf.quants.quantize(array, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_to_gguf(kind: str, tmp_path: Path, types: dict[str, Q] | None = None) -> tuple[Path, Path]:
    """(HF directory, the same weights as a GGUF file) for one hf_models architecture."""
    hf_dir = build_hf_model(kind, tmp_path / kind)
    return hf_dir, write_gguf(tmp_path / f"{kind}.gguf", hf_dir, GGUF_ARCH[kind], types)
