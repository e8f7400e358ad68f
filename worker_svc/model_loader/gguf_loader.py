"""Read a llama.cpp GGUF file: an HF-style config, and the weights under HF's tensor names.

The loader (worker_svc/model_loader/loader.py) treats a `.gguf` file as a second checkpoint format: the config
dict goes through the same `ModelConfig.from_dict` as a config.json, and the tensors through the
same name/shape checks and q/k/v fusing as safetensors. `pagoda.tools.default_model` uses the same two
functions to write an HF-format directory out of a GGUF.

Quantised blocks are dequantised here in torch, a few lines per supported type, with the same fp32
operations in the same order as the `gguf` package's numpy reference, so the result is bit-identical
to `gguf.quants.dequantize` (tests/worker/test_gguf_loader.py checks every type on random bytes).
Anything else (K-quants, IQ types...) is refused up front with the list of what is supported.

llama.cpp's converter permutes the rows of Llama's q/k projections (`LlamaModel.permute`) so that
its RoPE rotates interleaved pairs; HF's and ours rotate halves, so `_unpermute` reverses that.
Qwen2/Qwen3 are converted without the permutation (llama.cpp uses NEOX RoPE for them).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_svc.model_loader.errors import UnsupportedModelError

# GGUF `general.architecture` -> the HF architecture our model serves. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_PERMUTED_QK = ("llama",)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class UnsupportedTensorTypeError(ValueError):
    """A GGUF tensor is stored in a quantisation type this loader cannot dequantise."""


def _reader(path: str | Path) -> Any:
    import gguf  # only needed for GGUF checkpoints

    return gguf.GGUFReader(str(path))


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

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length") or hidden // heads)
    if meta("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(f"partial rotary ({meta('rope.dimension_count')} of {head_dim} "
                                    "dims) is not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
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
        "torch_dtype": _stored_dtype(reader),
    }
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(meta("rope.scaling.factor", 1.0))}
    # llama.cpp stops on every end-of-generation token: a chat model's end-of-turn is one.
    stop_ids = [i for i in (eos, _field(reader, "tokenizer.ggml.eot_token_id")) if i is not None]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": list(dict.fromkeys(stop_ids))}
    return config, generation


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
}


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

def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF parameter name; None for a name this mapping does not know."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    return None


def _unpermute(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    # Inverse of llama.cpp's permute: rows [heads, 2, D/2] were stored as [heads, D/2, 2].
    return tensor.reshape(num_heads, tensor.shape[0] // num_heads // 2, 2, *tensor.shape[1:]) \
        .transpose(1, 2).reshape(tensor.shape)


def read_tensors(path: str | Path, desc: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every tensor, dequantised one at a time under a progress bar.
    An unmapped name comes through unchanged (the loader reports it as an unknown weight)."""
    from tqdm import tqdm

    reader = _reader(path)
    config, _ = read_config(path)
    _check_supported({t.tensor_type.name for t in reader.tensors})  # before dequantising anything
    permute = config["model_type"] in _PERMUTED_QK
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for t in tqdm(reader.tensors, desc=desc or f"dequantising {Path(path).name}", unit="tensor",
                  disable=None):
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        tensor = dequantize(t.data, t.tensor_type.name, shape)
        name = hf_name(t.name) or t.name
        module = name.split(".")[-2] if "." in name else ""
        if permute and module in heads:
            tensor = _unpermute(tensor, heads[module])
        yield name, tensor
