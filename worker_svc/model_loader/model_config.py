"""The model's shape and options, parsed from an HF `config.json` (+ `generation_config.json`), or
from a GGUF file's metadata (worker_svc/model_loader/gguf_loader.py turns it into the same two dicts)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.runtime.model_files import is_gguf_file
from worker_svc.model_loader.errors import UnsupportedModelError
from worker_svc.model_loader.gguf_loader import read_config as read_gguf_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM",
                           "GraniteForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                           "OlmoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Vision-language wrappers (docs/vision.md): the language model is served from `text_config` by its
# own family's implementation; the vision tower and projector load beside it (models/llava_vision.py).
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else has "rope_type"
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 (or attention_bias=True)
    o_bias: bool  # attention_bias=True on Llama/Mistral/Qwen3
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None  # set when the model uses one (Mistral v0.1, Qwen2 opted in)
    # Per layer: the sliding window of that layer's attention, None for full attention. Mistral
    # windows every layer; Qwen2/Qwen3 (use_sliding_window) only layers >= max_window_layers; an
    # explicit HF `layer_types` list wins. Empty: every layer is full attention.
    layer_windows: tuple[int | None, ...] = ()
    partial_rotary_factor: float = 1.0  # Phi-3 family: RoPE turns only the first rotary_dim dims
    # Granite's scalings (1.0 / None elsewhere): embeddings times embedding_multiplier, each block's
    # output times residual_multiplier before the residual add, attention scale attention_multiplier
    # (None: head_dim ** -0.5), logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Gemma 2 / 3 (None elsewhere): scores soft-capped in attention (C * tanh(s / C)), logits likewise
    # after lm_head; Gemma 3's local (sliding-window) layers turn RoPE at their own base, plain, while
    # its global layers use rope_theta / rope_scaling. Gemma's query_pre_attn_scalar ** -0.5 is
    # attention_multiplier, and its GeGLU MLP hidden_act "gelu_pytorch_tanh".
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    hidden_act: str = "silu"
    # Mixture of experts (0 experts: a dense model). Each MoE layer routes every token to its
    # num_experts_per_tok best experts (softmax over the router logits, then top-k; the k weights
    # renormalised to sum to 1 when norm_topk_prob); each expert is a SiLU-gated MLP of width
    # moe_intermediate_size. Qwen3-MoE keeps a dense MLP (intermediate_size) on mlp_only_layers
    # and on layers whose 1-based index is not a multiple of decoder_sparse_step.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    multimodal: str | None = None  # the wrapper's architecture (MULTIMODAL_ARCHITECTURES); None: text only

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_window(self) -> int:
        """The widest window when every layer has one (KV before it is never read again), else 0."""
        windows = self.layer_windows
        return max(windows) if windows and None not in windows else 0  # type: ignore[type-var]

    def layer_window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """`path`: a local HF-format directory or a `.gguf` file."""
        path = Path(path)
        if is_gguf_file(path):
            return cls.from_dict(*read_gguf_config(path))
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: --model must be a local HF-format "
                                    "directory or a .gguf file")
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        raw, multimodal = _text_part(raw)
        arch = _architecture(raw)
        hidden_act = _hidden_act(raw, arch)
        if raw.get("mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        num_heads = int(raw["num_attention_heads"])
        attention_bias = bool(raw.get("attention_bias", False))
        rope_theta, rope_scaling = _rope(raw)
        sliding_window = _sliding_window(raw, arch)
        return cls(
            architecture=arch,
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=_eos_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=sliding_window,
            layer_windows=_layer_windows(raw, sliding_window, arch),
            partial_rotary_factor=_partial_rotary_factor(raw),
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
            attention_multiplier=_attention_multiplier(raw, arch),
            logits_scaling=float(raw.get("logits_scaling", 1.0)),
            attn_logit_softcapping=_optional_float(raw.get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
            local_rope_theta=_local_rope_theta(raw, arch),
            hidden_act=hidden_act,
            multimodal=multimodal,
            **_moe(raw, arch),
        )


def _text_part(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A vision-language config's language model config (and the wrapper's name); others as they are."""
    wrapper = next((a for a in raw.get("architectures") or () if a in MULTIMODAL_ARCHITECTURES), None)
    if wrapper is None:
        return raw, None
    text = dict(raw.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in _TEXT_ARCHITECTURES:
        raise UnsupportedModelError(f"{wrapper} with a {model_type!r} language model is not supported; "
                                    f"supported: {', '.join(_TEXT_ARCHITECTURES)}")
    text["architectures"] = [_TEXT_ARCHITECTURES[model_type]]
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):  # the wrapper's win where the text's are unset
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    return text, wrapper


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = ", ".join(archs) or f"model_type={raw.get('model_type')!r}"
    raise UnsupportedModelError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _hidden_act(raw: dict[str, Any], arch: str) -> str:
    if arch not in GEMMA_ARCHITECTURES:
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        return "silu"
    # HF's Gemma reads hidden_activation; older configs also carry a hidden_act it ignores.
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{arch}: hidden_activation {act!r} is not supported "
                                    "(only gelu_pytorch_tanh)")
    return act


def _attention_multiplier(raw: dict[str, Any], arch: str) -> float | None:
    if arch in GEMMA_ARCHITECTURES:  # Gemma scales scores by query_pre_attn_scalar ** -0.5 (HF's default 256)
        return float(raw.get("query_pre_attn_scalar", 256)) ** -0.5
    return _optional_float(raw.get("attention_multiplier"))


def _local_rope_theta(raw: dict[str, Any], arch: str) -> float | None:
    """Gemma 3's RoPE base for its sliding-window layers (None elsewhere: one RoPE for all layers)."""
    if arch != "Gemma3ForCausalLM":
        return None
    local = (raw.get("rope_parameters") or {}).get("sliding_attention")
    if local is not None:  # transformers 5: rope parameters per layer type
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"rope type {local['rope_type']!r} on sliding layers is not supported")
        return float(local.get("rope_theta", 10000.0))
    return float(raw.get("rope_local_base_freq", 10000.0))


def _moe(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of ModelConfig (none for a dense architecture)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    if raw.get("clip_qkv") is not None:  # OLMoE's option to clamp q/k/v
        raise UnsupportedModelError("clip_qkv is not supported")
    # Qwen3-MoE's config says num_experts; transformers 5 saves it as num_local_experts (Mixtral's).
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if num_experts < 1:
        raise UnsupportedModelError(f"{arch} config has no num_experts / num_local_experts")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        # Mixtral always renormalises the top-k weights; Qwen3-MoE and OLMoE say so in the config.
        "norm_topk_prob": arch == "MixtralForCausalLM" or bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from the legacy `rope_theta`/`rope_scaling` or the newer `rope_parameters`."""
    params = _global_rope_params(raw)
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    return theta, scaling


def _global_rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    # Gemma 3 under transformers 5: one entry per layer type; the sliding layers' is _local_rope_theta's.
    return params.get("full_attention") or {} if "full_attention" in params else params


def _partial_rotary_factor(raw: dict[str, Any]) -> float:
    params = _global_rope_params(raw)
    return float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids = _as_ids(raw.get("eos_token_id")) + _as_ids(generation.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))  # union, first-seen order


def _gemma_layer_types(raw: dict[str, Any], arch: str, num_layers: int) -> list[str] | None:
    # Hub configs older than `layer_types`: HF derives it. Gemma 2 alternates local / global from
    # layer 0; Gemma 3 makes every sliding_window_pattern-th layer (1-based) global.
    pattern = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": int(raw.get("sliding_window_pattern", 6))}.get(arch)
    if pattern is None:
        return None
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


# HF's Qwen configs carry a sliding_window that applies only with use_sliding_window (default off).
_OPT_IN_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None or not raw.get("use_sliding_window", arch not in _OPT_IN_WINDOW):
        return None
    return int(window)


def _layer_windows(raw: dict[str, Any], window: int | None, arch: str) -> tuple[int | None, ...]:
    """The window of each layer, as HF applies it (see ModelConfig.layer_windows)."""
    if window is None:
        return ()
    num_layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types") or _gemma_layer_types(raw, arch, num_layers)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    elif "max_window_layers" in raw:  # Qwen2 / Qwen3: the bottom max_window_layers layers stay full
        first = int(raw["max_window_layers"])
        windows = tuple(window if i >= first else None for i in range(num_layers))
    else:
        windows = (window,) * num_layers
    return windows if any(w is not None for w in windows) else ()
