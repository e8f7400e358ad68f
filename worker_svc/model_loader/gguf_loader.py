"""Read a llama.cpp GGUF file: an HF-style config, and the weights under HF's tensor names.

The loader (worker_svc/model_loader/loader.py) treats a `.gguf` file as a second checkpoint format: the config
dict goes through the same `ModelConfig.from_dict` as a config.json, and the tensors through the
same name/shape checks and q/k/v fusing as safetensors. `pagoda.tools.default_model` uses the same two
functions to write an HF-format directory out of a GGUF.

Quantised blocks are dequantised here in torch, a few lines per supported type, with the same fp32
operations in the same order as the `gguf` package's numpy reference, so the result is bit-identical
to `gguf.quants.dequantize` (tests/worker/test_gguf_loader.py checks every type on random bytes).
Anything else (IQ types, Q2_K, Q3_K...) is refused up front with the list of what is supported.

Served as stored (`read_tensors(..., keep_quantized=True)`): the linear weights of the types in
gguf_quants.DECODERS come through as `QuantizedWeight`s (their integers and scales, never widened)
and the loader builds `QuantLinear`s from them; norms, biases and float tensors are dequantised.

llama.cpp's converter permutes the rows of Llama's q/k projections (`LlamaModel.permute`) so that
its RoPE rotates interleaved pairs; HF's and ours rotate halves, so `_unpermute` reverses that.
Granite and Mixtral are converted by `LlamaModel` subclasses, so theirs are permuted too; Qwen2,
Qwen3, Qwen3-MoE, Phi-3, OLMo 2 and OLMoE are converted without it (llama.cpp uses NEOX RoPE for them).

Families beyond the Llama layout: Phi-3 stores q/k/v fused (`attn_qkv`) and gate+up fused in
`ffn_up`, as its HF checkpoints do (the loader splits both); OLMo 2 has post-norms
(`post_attention_norm`, `post_ffw_norm`) and no pre-norms; the mixture-of-experts families store
each layer's experts stacked into one 3-D tensor per projection (`ffn_gate_exps` [experts, inter,
hidden]...), which `read_tensors` splits back into HF's per-expert tensors. Mixtral has no GGUF
architecture of its own: it is `llama` with `llama.expert_count` set.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_svc.model_loader import gguf_quants
from worker_svc.model_loader.errors import UnsupportedModelError
from worker_svc.model_loader.quant_format import QuantizedWeight

# GGUF `general.architecture` -> the HF architecture our model serves. Mistral GGUFs say "llama",
# and so do Mixtral's (with experts: MIXTRAL below).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
MIXTRAL = "MixtralForCausalLM"
# HF's model_type where it is not the GGUF architecture's name (config.json written by default_model).
_MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", MIXTRAL: "mixtral"}
# convert_hf_to_gguf.py's LlamaModel (Llama, Mistral, Mixtral) and its subclass GraniteModel.
_PERMUTED_QK = ("llama", "granite")
# llama.cpp renormalises the top-k expert weights for these (hard-coded in its graphs, no GGUF key).
_NORM_TOPK = {"llama": True, "qwen3moe": True, "olmoe": False}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",  # OLMo 2
    "ffn_gate_inp": "mlp.gate",  # the MoE router
}
# Per HF architecture, where a GGUF name means something else than in _LAYER_NAMES.
_ARCH_LAYER_NAMES = {
    "Phi3ForCausalLM": {"ffn_up": "mlp.gate_up_proj"},  # llama.cpp's phi3 has no ffn_gate: up holds both
    MIXTRAL: {"ffn_gate_inp": "block_sparse_moe.gate"},
}
# Stacked experts -> HF's per-expert projection (Mixtral's: w1, w3, w2 under block_sparse_moe).
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class UnsupportedTensorTypeError(ValueError):
    """A GGUF tensor is stored in a quantisation type this loader cannot dequantise."""


# A worker start reads the file three times (config, the names kept quantized, the tensors). Inside
# `shared_readers()` they share one reader per file; outside it each read opens its own. The
# reader is gguf_file.GGUFFile (the header in ~0.2 s; gguf.GGUFReader parsed every field up front,
# 20+ s for Qwen2.5's 151k-token vocabulary on the 2-core machine). The shared ones are dropped
# when the outermost scope ends: no process keeps a file mapped that it is not loading from.
_shared: dict[tuple[str, int, int], Any] | None = None


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    global _shared
    outermost = _shared is None
    if outermost:
        _shared = {}
    try:
        yield
    finally:
        if outermost:
            _shared = None


def _reader(path: str | Path) -> Any:
    from worker_svc.model_loader.gguf_file import GGUFFile

    if _shared is None:
        return GGUFFile(str(path))
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _shared:
        _shared[key] = GGUFFile(key[0])
    return _shared[key]


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


# -- config ------------------------------------------------------------------------------------------

def read_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json dict, generation_config.json dict) from the GGUF metadata."""
    stat = Path(path).stat()
    config, generation = _cached_config(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
    return copy.deepcopy(config), copy.deepcopy(generation)


# Parsing a GGUF's metadata takes seconds (a 49k-token vocabulary), and a worker start asks for the
# config several times; keyed by mtime and size so a rewritten file is read again.
@functools.lru_cache(maxsize=4)
def _cached_config(path: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return config_from_reader(_reader(path))


def config_from_reader(reader: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; supported: "
                                    f"{', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:  # Llama 3.1-style frequency factors: not in the metadata
        raise UnsupportedModelError("GGUF rope_freqs (llama3 RoPE scaling) is not supported")
    if "rope_factors_long.weight" in names:  # Phi-3's LongRoPE (128k-context) factors
        raise UnsupportedModelError("GGUF rope_factors_long (Phi-3 LongRoPE scaling) is not supported")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    architecture = gguf_architecture(reader)
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length") or hidden // heads)
    rotary_dims = int(meta("rope.dimension_count", head_dim))
    # Phi-3's HF config may rotate part of each head (Phi-4-mini: 3/4); the other families' none.
    if rotary_dims != head_dim and arch != "phi3":
        raise UnsupportedModelError(f"partial rotary ({rotary_dims} of {head_dim} dims) is not "
                                    f"supported for GGUF architecture {arch!r}")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES.get(architecture, arch),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "vocab_size": int(meta("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        # Llama with biases has them on o_proj too; Qwen2's qkv bias follows from its architecture.
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        # HF's Phi-3 config defaults it to 32000, past a smaller vocabulary: written out for transformers
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": _stored_dtype(reader),
    }
    if rotary_dims != head_dim:
        config["partial_rotary_factor"] = rotary_dims / head_dim
    if arch == "granite":  # a key the file lacks keeps ModelConfig's default (no scaling)
        scales = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                  "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
        config.update({hf: float(meta(key)) for hf, key in scales.items() if meta(key) is not None})
    if meta("expert_count"):
        config.update(_moe_config(arch, architecture, meta, names))
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(meta("rope.scaling.factor", 1.0))}
    # llama.cpp stops on every end-of-generation token: a chat model's end-of-turn is one.
    stop_ids = [i for i in (eos, _field(reader, "tokenizer.ggml.eot_token_id")) if i is not None]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": list(dict.fromkeys(stop_ids))}
    return config, generation


def gguf_architecture(reader: Any) -> str:
    """The HF architecture of a GGUF (its `general.architecture` must be supported)."""
    arch = _field(reader, "general.architecture")
    if arch == "llama" and _field(reader, "llama.expert_count"):
        return MIXTRAL
    return GGUF_ARCHITECTURES[arch]


def _moe_config(arch: str, architecture: str, meta: Callable[..., Any], names: set[str]) -> dict[str, Any]:
    """The config.json keys of a mixture-of-experts GGUF (as HF's config of that family names them)."""
    if arch not in _NORM_TOPK:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not supported")
    if meta("attention.clamp_kqv") is not None:  # OLMoE's clip_qkv, which ModelConfig refuses too
        raise UnsupportedModelError("GGUF attention.clamp_kqv (clip_qkv) is not supported")
    layers = int(meta("block_count"))
    # A layer without a router is a dense one (Qwen3-MoE's mlp_only_layers; llama.cpp itself expects
    # every layer to be MoE, so its converter writes none such).
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    experts = "num_local_experts" if architecture == MIXTRAL else "num_experts"
    return {
        experts: int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        # Mixtral's and OLMoE's feed_forward_length is the experts' width; Qwen3-MoE writes both.
        "moe_intermediate_size": int(meta("expert_feed_forward_length") or meta("feed_forward_length")),
        "norm_topk_prob": bool(meta("expert_weights_norm", _NORM_TOPK[arch])),
        "mlp_only_layers": dense,
    }


def _stored_dtype(reader: Any) -> str:
    """"auto" dtype: the matrices' float type when all share one, else float32 (quantised files)."""
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    return {"F16": "float16", "BF16": "bfloat16"}.get(types.pop() if len(types) == 1 else "", "float32")


# -- dequantisation ----------------------------------------------------------------------------------

def _f16(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [n, 2] uint8 -> [n, 1] float32 (a block's fp16 scale or minimum)
    return blocks.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # qs: [n, 16] uint8 -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # [n, 18]: fp16 d, 16 bytes of nibbles; x = d * (q - 8)
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # [n, 20]: fp16 d, fp16 m, nibbles; x = d * q + m
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # [n, 34]: fp16 d, 32 int8; x = d * q
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _float(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda raw: raw.contiguous().view(dtype).float()


# type name -> (bytes per block, uint8 [blocks, bytes per block] -> fp32 [blocks, elements per block])
DEQUANTISERS: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "F32": (4, _float(torch.float32)), "F16": (2, _float(torch.float16)), "BF16": (2, _float(torch.bfloat16)),
    "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q8_0": (34, _q8_0),
    # Q5_0/Q5_1 and the K-quants through their exact decoding (worker_svc/model_loader/gguf_quants.py)
    **{name: (gguf_quants.DECODERS[name][0], gguf_quants.dequantizer(name))
       for name in ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")},
}
# GGUF linear weights (HF module names) that may stay quantized: the dense projections and the
# output head (token_embd too: it is the lm_head of a tied model). Experts are dequantised.
QUANTIZABLE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                       "qkv_proj", "gate_up_proj", "lm_head", "embed_tokens")


def _check_supported(type_names: set[str]) -> None:
    bad = sorted(type_names - set(DEQUANTISERS))
    if bad:
        raise UnsupportedTensorTypeError(f"unsupported GGUF tensor type: {', '.join(bad)}; "
                                         f"supported: {', '.join(DEQUANTISERS)}")


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's raw data (any numpy view of its bytes) -> fp32 tensor of `shape` (numpy order)."""
    _check_supported({type_name})
    type_size, fn = DEQUANTISERS[type_name]
    raw = torch.from_numpy(np.array(data, copy=True).view(np.uint8).reshape(-1))  # the mmap is read-only
    return fn(raw.view(-1, type_size)).reshape(shape)


# -- weights -----------------------------------------------------------------------------------------

def hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """GGUF tensor name -> HF parameter name (of `architecture`, the HF one); None for a name this
    mapping does not know. Stacked experts map to a template with `{}` for the expert's index."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if not match:
        return None
    layer, module = match[1], match[2]
    if module in _EXPERT_NAMES:
        projection = _EXPERT_NAMES[module]
        if architecture == MIXTRAL:
            return f"model.layers.{layer}.block_sparse_moe.experts.{{}}.{_MIXTRAL_EXPERTS[projection]}.{kind}"
        return f"model.layers.{layer}.mlp.experts.{{}}.{projection}.{kind}"
    hf = _ARCH_LAYER_NAMES.get(architecture, {}).get(module) or _LAYER_NAMES.get(module)
    return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"


def _unpermute(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    # Inverse of llama.cpp's permute: rows [heads, 2, D/2] were stored as [heads, D/2, 2].
    return tensor.reshape(num_heads, tensor.shape[0] // num_heads // 2, 2, *tensor.shape[1:]) \
        .transpose(1, 2).reshape(tensor.shape)


def quantized_names(path: str | Path) -> set[str]:
    """HF names of the weights `read_tensors(path, keep_quantized=True)` yields as QuantizedWeight."""
    reader = _reader(path)
    architecture = gguf_architecture(reader)
    return {name for t in reader.tensors if (name := _kept_name(t, architecture)) is not None}


def _kept_name(t: Any, architecture: str) -> str | None:
    name = hf_name(t.name, architecture)
    if name is None or "{}" in name or t.tensor_type.name not in gguf_quants.DECODERS or len(t.shape) != 2:
        return None
    return name if name.endswith(".weight") and name.split(".")[-2] in QUANTIZABLE_MODULES else None


def _unpermute_rows(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    rows = weight.shape[0]
    return weight.rows(_unpermute(torch.arange(rows), num_heads))


def read_tensors(path: str | Path, desc: str | None = None,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, fp32 tensor) for every tensor, dequantised one at a time under a progress bar.
    An unmapped name comes through unchanged (the loader reports it as an unknown weight).
    keep_quantized: the weights `quantized_names` lists come as QuantizedWeight instead."""
    from tqdm import tqdm

    reader = _reader(path)
    config, _ = read_config(path)
    _check_supported({t.tensor_type.name for t in reader.tensors})  # before dequantising anything
    architecture = config["architectures"][0]
    permute = _field(reader, "general.architecture") in _PERMUTED_QK
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for t in tqdm(reader.tensors, desc=desc or f"dequantising {Path(path).name}", unit="tensor",
                  disable=None):
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        name = hf_name(t.name, architecture) or t.name
        if keep_quantized and _kept_name(t, architecture) is not None:
            raw = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8).reshape(-1))
            weight = gguf_quants.decode(raw, t.tensor_type.name, *shape)
            module = name.split(".")[-2]
            yield name, _unpermute_rows(weight, heads[module]) if permute and module in heads else weight
            continue
        tensor = dequantize(t.data, t.tensor_type.name, shape)
        if "{}" in name:  # stacked experts [experts, rows, cols]: HF's checkpoints hold one per expert
            # cloned: a view would keep the whole stack alive, and safetensors refuses shared storage
            yield from ((name.format(e), tensor[e].clone()) for e in range(tensor.shape[0]))
            continue
        module = name.split(".")[-2] if "." in name else ""
        if permute and module in heads:
            tensor = _unpermute(tensor, heads[module])
        yield name, tensor
