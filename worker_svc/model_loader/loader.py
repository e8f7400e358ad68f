"""Load a checkpoint into our model: an HF-format directory (config.json + safetensors, single file
or sharded) or a llama.cpp `.gguf` file (worker_svc/model_loader/gguf_loader.py maps its names and dequantises).

Both formats become one stream of (HF tensor name, tensor) pairs, so everything after is shared:
HF's separate q/k/v and gate/up weights are copied into the fused `qkv_proj` / `gate_up_proj`
parameters row-slice by row-slice, cast to the compute dtype. A checkpoint that stores them fused
already (Phi-3) is first split back into the separate tensors, so TP slices it like any other.
Every parameter must be filled exactly once; an unknown or missing tensor is an error naming it.

Mixture of experts (worker_svc/models/moe.py): each expert's `mlp.experts.N.{gate,up,down}_proj`
is copied into slot N of the stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`.
Mixtral's names (`block_sparse_moe`, experts' w1/w3/w2) are renamed to those; a checkpoint that
stores the experts stacked already (transformers 5's in-memory layout) is split per expert first.

Tensor parallelism: each rank takes only its slice of a sharded tensor: rows of q/k/v and gate/up
(column-parallel, every expert's too), columns of o_proj and down_proj (row-parallel); everything else, biases of
row-parallel layers included, is read whole (replicated). Safetensors are sliced on read
(`safe_open.get_slice`); GGUF tensors are dequantised whole, then narrowed.

Quantized weights (docs/quantization.md): `quantization="gguf"` keeps a GGUF's Q8_0 / Q4_0 / Q4_1 /
Q4_K / Q5_K / Q6_K linear weights as stored. The linears whose every part is so stored are swapped
for empty `QuantLinear`s while the model is still on the meta device (no float storage is ever
allocated for them) and filled row range by row range; a tied lm_head also serves the embedding
(`QuantEmbedding`). `quantization="int8" | "int4"` quantizes an HF directory's linears after loading.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pagoda.runtime.model_files import is_gguf_file
from worker_svc.model_loader import gguf_loader
from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.model_loader.quant_format import QUANTIZATION_METHODS, QuantizedWeight
from worker_svc.models import model_class
from worker_svc.models.common import RotaryEmbedding
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.quant_linear import (
    QuantEmbedding,
    QuantLinear,
    interleave_rows,
    keep_half_scales,
    quantize_linears,
)
from worker_svc.parallel.distributed import SINGLE, TensorParallel
from worker_svc.parallel.pipeline import SINGLE_STAGE, PipelineStage

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
# Checkpoint tensors that carry no weights (old Llama exports saved the RoPE buffer).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not match the model (unknown, missing, or wrong shape)."""


def resolve_dtype(name: str, model_config: ModelConfig) -> torch.dtype:
    """"auto" follows config.json's dtype; otherwise the named dtype."""
    key = model_config.torch_dtype if name == "auto" else name
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {key!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[key]


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
               tp: TensorParallel = SINGLE, quantization: str | None = None,
               stage: PipelineStage = SINGLE_STAGE) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`model_dir`: an HF-format directory or a `.gguf` file. `quantization`: None (float weights),
    "gguf" (a GGUF's quantized linears kept as stored) or "int8" / "int4" (computed at load).
    `stage`: a pipeline stage loads only its own layers' (and ends') tensors."""
    if quantization not in (None, "gguf", *QUANTIZATION_METHODS):
        raise ValueError(f"unknown quantization {quantization!r}; choose {', '.join(QUANTIZATION_METHODS)}")
    with gguf_loader.shared_readers():  # a GGUF's metadata parsed once for the whole load
        cfg = ModelConfig.from_dir(model_dir)
        device = torch.device(device)
        keep = quantization == "gguf" and is_gguf_file(model_dir)
        # On meta, and with the modules' init functions off: every parameter is overwritten by the checkpoint
        with torch.device("meta"), _no_weight_init():
            model = model_class(cfg)(cfg, tp)
            model.keep_stage(stage)
            if keep:
                swap_quantized_linears(model, gguf_loader.quantized_names(model_dir))
        # Cast on meta first (free), so the device holds only `dtype` storage, never an fp32 copy.
        model = model.to(dtype).to_empty(device=device)
        model.tie_weights()  # to_empty re-creates parameters, which unties them
        for module in model.modules():  # Gemma 3 has a second RoPE for its local layers
            if isinstance(module, RotaryEmbedding):
                module.reset_cache(device, dtype)
            if isinstance(module, QuantEmbedding):  # its rows come out in the compute dtype
                module.dtype = dtype
        load_weights(model, Path(model_dir), keep_quantized=keep)
        if quantization in QUANTIZATION_METHODS:
            quantize_linears(model, quantization)
        if keep:
            keep_half_scales(model)  # Q8_0's scales as the file stores them, where the int16 path reads them
        if keep or quantization in QUANTIZATION_METHODS:
            interleave_rows(model)  # 8-bit codes as the int16 kernel streams them best
        model.eval().requires_grad_(False)
        return model, cfg


# nn.init's functions the modules' reset_parameters call. On meta they do nothing useful, and one
# (Embedding's normal_) goes through a decomposition that imports torch._dynamo: 1.5 s and ~70 MiB
# of RSS in every worker, for nothing. (transformers' no_init_weights does this too, but its import
# pulls in the same dynamo.)
_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "trunc_normal_", "constant_", "zeros_", "ones_")


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    originals = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in originals.items():
            setattr(torch.nn.init, name, function)


def _sources(name: str, tied: bool) -> list[list[str]]:
    """The checkpoint names a linear of ours is loaded from: one list per way a checkpoint may
    store it (HF's separate q/k/v, or pre-fused as Phi-3's)."""
    prefix, _, module = name.rpartition(".")
    if module == "lm_head":
        return [["model.embed_tokens.weight" if tied else "lm_head.weight"]]
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(module)
    whole = [f"{name}.weight"]
    return [whole, [f"{prefix}.{p}.weight" for p in parts]] if parts else [whole]


def swap_quantized_linears(model: torch.nn.Module, kept: set[str]) -> int:
    """On meta: every `nn.Linear` whose checkpoint parts are all in `kept` (stored quantized)
    becomes an empty `QuantLinear` (a tied lm_head brings a `QuantEmbedding`). Returns how many."""
    tied = model.config.tie_word_embeddings
    swapped = 0
    for name, linear in list(model.named_modules()):
        if not isinstance(linear, torch.nn.Linear) or not any(set(s) <= kept for s in _sources(name, tied)):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(linear.in_features, linear.out_features, linear.bias is not None))
        swapped += 1
    if tied and isinstance(model.lm_head, QuantLinear):
        model.model.embed_tokens = QuantEmbedding(model.lm_head, model.model.embed_tokens.weight.dtype)
    embed = model.model.embed_tokens
    if not tied and type(embed) is torch.nn.Embedding and "model.embed_tokens.weight" in kept:
        # an untied quantized token_embd stays quantized too (its tokens' rows widened per step)
        table = QuantLinear(embed.embedding_dim, embed.num_embeddings)
        model.model.embed_tokens = QuantEmbedding(table, embed.weight.dtype, own=True)
    return swapped


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (PyTorch .bin is not supported)")
    return found


def _fused_targets(cfg: ModelConfig, tp_size: int = 1) -> dict[str, tuple[str, str, int, int]]:
    """HF projection name -> (our fused name, shard key, first row, row count), in this rank's
    fused parameter (each rank holds 1/tp_size of every part)."""
    q, kv = cfg.num_heads * cfg.head_dim // tp_size, cfg.num_kv_heads * cfg.head_dim // tp_size
    inter = cfg.intermediate_size // tp_size
    return {"q_proj": ("qkv_proj", "q", 0, q), "k_proj": ("qkv_proj", "k", q, kv),
            "v_proj": ("qkv_proj", "v", q + kv, kv),
            "gate_proj": ("gate_up_proj", "gate", 0, inter), "up_proj": ("gate_up_proj", "up", inter, inter)}


def _expected_shards(params: dict[str, torch.nn.Parameter]) -> dict[str, set[str]]:
    expected = {}
    for name, param in params.items():
        if name.endswith(".experts.gate_up_proj"):
            expected[name] = {f"{e}.{part}" for e in range(param.shape[0]) for part in ("gate", "up")}
        elif name.endswith(".experts.down_proj"):
            expected[name] = {str(e) for e in range(param.shape[0])}
        elif ".qkv_proj." in name:
            expected[name] = {"q", "k", "v"}
        elif ".gate_up_proj." in name:
            expected[name] = {"gate", "up"}
        else:
            expected[name] = {""}
    return expected


# A checkpoint tensor, read (and TP-sliced) only when called: skipped tensors are never read.
TensorReader = Callable[[], torch.Tensor]


def _quant_slots(model: LlamaForCausalLM) -> dict[str, QuantLinear]:
    """Weight name -> the QuantLinear it fills (a tied quantized lm_head: the embedding's name)."""
    slots = {(f"{name}.weight" if not name.endswith("embed_tokens.table") else "model.embed_tokens.weight"): m
             for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    if model.config.tie_word_embeddings and isinstance(model.lm_head, QuantLinear):
        slots = {("model.embed_tokens.weight" if k == "lm_head.weight" else k): m for k, m in slots.items()}
    return slots


def load_weights(model: LlamaForCausalLM, model_dir: Path, keep_quantized: bool = False) -> None:
    cfg: ModelConfig = model.config
    params = dict(model.named_parameters())  # tied lm_head.weight appears once, as embed_tokens
    slots = _quant_slots(model)
    # _target resolves names against shapes alone: an empty QuantLinear stands in as a meta tensor
    targets = {**params, **{k: torch.empty(m.out_features, m.in_features, device="meta") for k, m in slots.items()}}
    tp: TensorParallel = model.tp
    fused = _fused_targets(cfg, tp.size)
    expected = _expected_shards(targets)
    loaded: dict[str, set[str]] = {name: set() for name in targets}
    tensors = (_gguf_tensors(model_dir, tp, keep_quantized) if is_gguf_file(model_dir)
               else _safetensors(model_dir, tp))
    tensors = _unfused(_renamed(tensors), cfg, tp)
    for name, read in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight") \
                or not model.holds(name):  # another pipeline stage's
            continue
        target, shard, expert, start, rows = _target(name, fused, targets)
        tensor = read()
        if target in slots:
            module = slots[target]
            want = (rows or module.out_features, module.in_features)
            if not isinstance(tensor, QuantizedWeight) or tuple(tensor.shape) != want:
                raise WeightLoadError(f"{name}: expected a quantized {want} weight, got "
                                      f"{type(tensor).__name__} {tuple(tensor.shape)}")
            module.load_rows(start, tensor)
            loaded[target].add(shard)
            continue
        if isinstance(tensor, QuantizedWeight):  # a part of a linear that stays float
            tensor = tensor.dequantize()
        dest = params[target].data
        dest = dest if expert is None else dest[expert]
        dest = dest if rows == 0 else dest.narrow(0, start, rows)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                  f"model shape {tuple(dest.shape)} (config mismatch?)")
        dest.copy_(tensor)
        loaded[target].add(shard)
    missing = [f"{name}[{shard}]" if shard else name for name, shards in expected.items()
               for shard in sorted(shards - loaded[name])]
    if missing:
        raise WeightLoadError(f"{len(missing)} weights missing from {model_dir}: {', '.join(missing[:8])}")


def _safetensors(model_dir: Path, tp: TensorParallel) -> Iterator[tuple[str, TensorReader]]:
    files = checkpoint_files(model_dir)
    total = sum(_num_tensors(f) for f in files)
    with tqdm(total=total, desc=f"loading {model_dir.name}", unit="tensor", disable=None) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    bar.update(1)
                    yield name, lambda name=name, reader=reader: (
                        _read_shard(reader, name, tp) if tp.size > 1 else reader.get_tensor(name))


def _gguf_tensors(path: Path, tp: TensorParallel, keep_quantized: bool = False) -> Iterator[tuple[str, TensorReader]]:
    # dequantised to fp32 one by one (progress bar), or kept as QuantizedWeight
    for name, tensor in gguf_loader.read_tensors(path, keep_quantized=keep_quantized):
        yield name, lambda name=name, tensor=tensor: _narrow_shard(tensor, name, tp)


# Checkpoint-fused projections (Phi-3) -> the separate HF projections their rows stack, in order.
_PREFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Mixtral's expert projections -> the names Qwen3-MoE / OLMoE (and our model) use.
_MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _renamed(tensors: Iterable[tuple[str, TensorReader]]) -> Iterator[tuple[str, TensorReader]]:
    """Mixtral's `block_sparse_moe.gate` / `block_sparse_moe.experts.N.w1|w3|w2` -> `mlp.gate` /
    `mlp.experts.N.gate_proj|up_proj|down_proj` (the reader keeps the original name for slicing)."""
    for name, read in tensors:
        name = _language_model_name(name)
        if name is None:  # the vision tower's or the projector's (models/llava_vision.py loads them)
            continue
        parts = name.split(".")
        if "block_sparse_moe" in parts:
            parts[parts.index("block_sparse_moe")] = "mlp"
            if len(parts) >= 2 and parts[-2] in _MIXTRAL_EXPERTS and "experts" in parts:
                parts[-2] = _MIXTRAL_EXPERTS[parts[-2]]
            name = ".".join(parts)
        yield name, read


# A vision-language checkpoint's language model tensors -> the text model's names; vision ones -> None.
_LM_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _language_model_name(name: str) -> str | None:
    for old, new in _LM_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return None if name.startswith(_VISION_PREFIXES) else name


def _stacked_experts(name: str, read: TensorReader, cfg: ModelConfig,
                     tp: TensorParallel) -> Iterator[tuple[str, TensorReader]]:
    """`...experts.gate_up_proj` [E, 2 I, hidden] / `...experts.down_proj` [E, hidden, I], read
    whole once -> each expert's `...experts.N.gate_proj.weight` etc., narrowed to this rank's slice."""
    prefix, kind = name.rsplit(".", 1)
    whole = functools.cache(read)
    inter = cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        if kind == "down_proj":
            pieces = (("down_proj", None),)
        else:
            pieces = (("gate_proj", (0, inter)), ("up_proj", (inter, inter)))
        for part, rows in pieces:
            sub = f"{prefix}.{e}.{part}.weight"

            def piece(e=e, rows=rows, sub=sub) -> torch.Tensor:
                tensor = whole()
                if tensor.shape[0] != cfg.num_experts:
                    raise WeightLoadError(f"{name}: checkpoint has {tensor.shape[0]} experts, the "
                                          f"config says {cfg.num_experts} (config mismatch?)")
                tensor = tensor[e] if rows is None else tensor[e].narrow(0, *rows)
                return _narrow_shard(tensor, sub, tp)
            yield sub, piece


def _unfused(tensors: Iterable[tuple[str, TensorReader]], cfg: ModelConfig,
             tp: TensorParallel) -> Iterator[tuple[str, TensorReader]]:
    """Split each pre-fused tensor into the separate ones it stacks (`...qkv_proj.weight` into
    `...q_proj.weight`, `...k_proj.weight`, `...v_proj.weight`), each narrowed to this rank's slice;
    every other tensor passes as it is. The fused tensor is read whole, once."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    rows = {"qkv_proj": (q, kv, kv), "gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
    for name, read in tensors:
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module == "experts" and parts[-1] in ("gate_up_proj", "down_proj"):
            yield from _stacked_experts(name, read, cfg, tp)
            continue
        if module not in _PREFUSED:
            yield name, read
            continue
        whole = functools.cache(functools.partial(_read_rows, name, read, sum(rows[module])))
        start = 0
        for part, count in zip(_PREFUSED[module], rows[module], strict=True):
            sub = ".".join([*parts[:-2], part, parts[-1]])
            yield sub, lambda sub=sub, whole=whole, start=start, count=count: _narrow_shard(
                whole().narrow(0, start, count), sub, tp)
            start += count


def _read_rows(name: str, read: TensorReader, rows: int) -> torch.Tensor:
    tensor = read()
    if tensor.shape[0] != rows:
        raise WeightLoadError(f"{name}: checkpoint has {tensor.shape[0]} rows, the config implies "
                              f"{rows} (config mismatch?)")
    return tensor


# (Mixtral's experts: w1 = gate, w3 = up, w2 = down; the stacked experts are split per expert first.)
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")  # output rows
_ROW_PARALLEL = ("o_proj", "down_proj", "w2")  # split input columns (weights only; biases replicated)


def _split_dim(name: str) -> int | None:
    """The dimension TP splits this tensor along; None when every rank holds it whole."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if module == "experts":  # stacked experts: read whole, split per expert (_stacked_experts)
        return None
    if module in _COLUMN_PARALLEL:
        return 0
    if module in _ROW_PARALLEL and kind == "weight":
        return 1
    return None


def _shard_range(name: str, dim: int, full: int, tp: TensorParallel) -> tuple[int, int]:
    """(first index, length) of this rank's slice of dimension `dim` (size `full`)."""
    if full % tp.size:
        raise WeightLoadError(f"{name}: dimension {dim} ({full}) is not divisible by "
                              f"tensor_parallel_size {tp.size}")
    step = full // tp.size
    return tp.rank * step, step


def _read_shard(reader, name: str, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of a safetensors tensor, read without loading the rest."""
    dim = _split_dim(name)
    if dim is None:
        return reader.get_tensor(name)
    tensor_slice = reader.get_slice(name)
    start, step = _shard_range(name, dim, tensor_slice.get_shape()[dim], tp)
    if dim == 0:
        return tensor_slice[start:start + step]
    return tensor_slice[:, start:start + step]


def _narrow_shard(tensor: torch.Tensor, name: str, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of a tensor already in memory."""
    dim = _split_dim(name)
    if dim is None or tp.size == 1:
        return tensor
    return tensor.narrow(dim, *_shard_range(name, dim, tensor.shape[dim], tp))


def _num_tensors(file: Path) -> int:
    with safe_open(file, framework="pt") as reader:
        return len(reader.keys())


def _target(name: str, fused: dict[str, tuple[str, str, int, int]],
            params: dict[str, torch.nn.Parameter]) -> tuple[str, str, int | None, int, int]:
    """Checkpoint tensor name -> (our parameter name, shard key, expert index or None, first row,
    row count; 0 rows: the whole parameter, or the expert's whole slot)."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-1] == "weight":
        expert, module = int(parts[-3]), parts[-2]
        prefix = ".".join(parts[:-3])
        stacked = params.get(f"{prefix}.down_proj")
        if stacked is not None and expert >= stacked.shape[0]:
            raise WeightLoadError(f"{name}: expert {expert} is past the config's num_experts "
                                  f"({stacked.shape[0]})")
        if module == "down_proj" and f"{prefix}.down_proj" in params:
            return f"{prefix}.down_proj", str(expert), expert, 0, 0
        if module in ("gate_proj", "up_proj") and f"{prefix}.gate_up_proj" in params:
            inter = params[f"{prefix}.gate_up_proj"].shape[1] // 2
            part = module.removesuffix("_proj")
            return (f"{prefix}.gate_up_proj", f"{expert}.{part}", expert,
                    0 if part == "gate" else inter, inter)
    for i, part in enumerate(parts):
        if part in fused:
            ours, shard, start, rows = fused[part]
            target = ".".join(parts[:i] + [ours] + parts[i + 1:])
            if target in params:
                return target, shard, None, start, rows
    if name in params:
        return name, "", None, 0, 0
    raise WeightLoadError(f"unknown weight {name!r} in checkpoint: the model has no such parameter")
