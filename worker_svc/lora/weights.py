"""Read a PEFT LoRA adapter into the layout of Pagoda's fused projections.

PEFT stores, per target module, lora_A [r, in] and lora_B [out, r]; its delta is
`x @ A.T @ B.T * scaling`. Pagoda fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so
one fused projection carries up to three sub-adapters. They are laid side by side: A_fused
[in, n_sub * R] (sub i in columns [i*R, i*R + r_i]) and B_fused [R, out] (sub i's B in its own
output columns, rows [0, r_i)): one matmul shrinks for every sub at once, and each sub expands into
its own columns only (layers.expand_into), so B holds no zero blocks to stream. The zero padding
(ranks below R, untargeted subs) adds exact zeros. Scaling is folded into B.

Tensor parallelism splits the adapters like the base weights: for the column-parallel qkv and
gate_up each rank keeps all of A and its own output columns of B (its heads' / MLP columns'); for
the row-parallel o and down it keeps its rows of A (its slice of the input) and all of B, so its
delta is a partial product that the layer's all-reduce sums with the base one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.lora import WEIGHTS_FILE, read_adapter_config
from worker_svc.model_loader.model_config import ModelConfig

# PEFT module -> (fused projection, sub index inside it)
PEFT_TO_FUSED = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
                 "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


@dataclass(frozen=True, slots=True)
class FusedShape:
    """One fused projection: its input width and the output width of each sub-projection."""

    in_features: int
    sub_out: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.sub_out)


ROW_PARALLEL = ("o", "down")  # split on the input under TP; qkv and gate_up on the output


def fused_shapes(cfg: ModelConfig, tp_size: int = 1) -> dict[str, FusedShape]:
    """The projections' shapes on one of `tp_size` ranks."""
    q = cfg.num_heads * cfg.head_dim // tp_size
    kv = cfg.num_kv_heads * cfg.head_dim // tp_size
    h, inter = cfg.hidden_size, cfg.intermediate_size // tp_size
    return {"qkv": FusedShape(h, (q, kv, kv)), "o": FusedShape(q, (h,)),
            "gate_up": FusedShape(h, (inter, inter)), "down": FusedShape(inter, (h,))}


@dataclass(slots=True)
class AdapterWeights:
    """An adapter on the host, ready to copy into a device slot."""

    # (layer index, fused projection) -> (A [in, n_sub * R], B [R, out]), scaling in B
    matrices: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(proj for _, proj in self.matrices)


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1) -> AdapterWeights:
    """InvalidRequestError for anything Pagoda cannot apply exactly (unknown tensors, shapes, rank).
    Under TP: this rank's share (module docstring)."""
    config = read_adapter_config(path, max_rank)
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    full, shapes = fused_shapes(cfg), fused_shapes(cfg, tp_size)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in PEFT_TO_FUSED or int(match.group(1)) >= cfg.num_layers:
            raise InvalidRequestError(f"LoRA adapter {path}: tensor {key} targets nothing Pagoda "
                                      f"applies LoRA to (q/k/v/o_proj, gate/up/down_proj)")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    matrices: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        proj, sub = PEFT_TO_FUSED[module]
        shape = shapes[proj]
        a, b = _check_pair(path, layer, module, ab, full[proj].in_features, full[proj].sub_out[sub], max_rank)
        if proj in ROW_PARALLEL:  # a: [r, in] -> this rank's input columns
            a = a[:, tp_rank * shape.in_features:(tp_rank + 1) * shape.in_features]
        else:  # b: [out, r] -> this rank's output rows
            b = b[tp_rank * shape.sub_out[sub]:(tp_rank + 1) * shape.sub_out[sub]]
        if (layer, proj) not in matrices:
            matrices[layer, proj] = (torch.zeros(shape.in_features, len(shape.sub_out) * max_rank),
                                     torch.zeros(max_rank, shape.out_features))
        fused_a, fused_b = matrices[layer, proj]
        rank, rows, cols = a.shape[0], sub * max_rank, sum(shape.sub_out[:sub])
        fused_a[:, rows:rows + rank] = a.float().T
        fused_b[:rank, cols:cols + b.shape[0]] = b.float().T * config.scaling(rank)
    return AdapterWeights({k: (a.to(dtype), b.to(dtype)) for k, (a, b) in matrices.items()})


def _check_pair(path: str | Path, layer: int, module: str, ab: dict[str, torch.Tensor],
                in_features: int, out_features: int, max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"LoRA adapter {path}: layer {layer} {module}"
    if set(ab) != {"A", "B"}:
        raise InvalidRequestError(f"{where} has lora_A or lora_B missing")
    a, b = ab["A"], ab["B"]  # [r, in], [out, r]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise InvalidRequestError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                  "do not pair")
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise InvalidRequestError(f"{where}: shapes {tuple(a.shape)} / {tuple(b.shape)} do not fit "
                                  f"the base model ({in_features} -> {out_features})")
    if a.shape[0] > max_rank:
        raise InvalidRequestError(f"{where}: rank {a.shape[0]} is above --max-lora-rank {max_rank}")
    return a, b
