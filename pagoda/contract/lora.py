"""LoRA adapters as every process names them: the request (vLLM's `LoRARequest`) and the checks on
a PEFT adapter directory that need no torch (adapter_config.json only).

A request's adapter travels gateway -> scheduler -> worker with its path; the worker loads the
weights itself (worker_svc/lora/). `cache_key` identifies the weights wherever a cache is keyed by
adapter (the prefix cache, the worker's slots): name *and* path, so an adapter unloaded and
re-registered under the same name from another directory never reuses the old one's KV blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagoda.contract.errors import InvalidRequestError

# PEFT module names Pagoda applies LoRA to (mapped onto the fused qkv_proj / gate_up_proj).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's spelling: `LoRARequest(lora_name, lora_int_id, lora_path)`."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise InvalidRequestError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise InvalidRequestError(f"LoRA adapter {self.lora_name!r} needs a path")

    @property
    def cache_key(self) -> str:
        return f"{self.lora_name}\x00{self.lora_path}"


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What Pagoda reads from adapter_config.json."""

    rank: int  # `r`; per-module ranks (rank_pattern) come from the tensors' shapes
    lora_alpha: float
    use_rslora: bool  # scaling alpha / sqrt(r) instead of alpha / r

    def scaling(self, rank: int) -> float:
        return self.lora_alpha / (rank**0.5 if self.use_rslora else rank)


def read_adapter_config(path: str | Path, max_lora_rank: int | None = None) -> AdapterConfig:
    """Parse and check a PEFT LoRA directory; InvalidRequestError says what is wrong."""
    directory = Path(path)
    config_path = directory / CONFIG_FILE
    try:  # is_file() raises past ENOENT: a name too long for the file system, say
        has_config, has_weights = config_path.is_file(), (directory / WEIGHTS_FILE).is_file()
    except OSError as error:
        raise InvalidRequestError(f"no LoRA adapter at {path}: {error.strerror}") from None
    if not has_config:
        raise InvalidRequestError(f"no LoRA adapter at {path}: {CONFIG_FILE} not found")
    if not has_weights:
        raise InvalidRequestError(f"no LoRA adapter at {path}: {WEIGHTS_FILE} not found")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise InvalidRequestError(f"{config_path}: not readable JSON ({error})") from None
    unsupported = _unsupported_features(raw)
    if unsupported:
        raise InvalidRequestError(f"LoRA adapter {path}: {unsupported} is not supported")
    rank = int(raw.get("r", 8))
    ranks = [rank, *map(int, (raw.get("rank_pattern") or {}).values())]
    if max_lora_rank is not None and max(ranks) > max_lora_rank:
        raise InvalidRequestError(f"LoRA adapter {path} has rank {max(ranks)}, above "
                                  f"--max-lora-rank {max_lora_rank}")
    return AdapterConfig(rank=rank, lora_alpha=float(raw.get("lora_alpha", 8)),
                         use_rslora=bool(raw.get("use_rslora", False)))


def _unsupported_features(raw: dict) -> str | None:
    if raw.get("peft_type", "LORA") != "LORA":
        return f"peft_type {raw.get('peft_type')!r} (only LORA)"
    if raw.get("use_dora"):
        return "DoRA (use_dora)"
    if raw.get("bias", "none") != "none":
        return f"bias={raw.get('bias')!r} (only 'none')"
    if raw.get("modules_to_save"):
        return "modules_to_save"
    if raw.get("alpha_pattern"):
        return "alpha_pattern"
    if raw.get("fan_in_fan_out"):
        return "fan_in_fan_out"
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(SUPPORTED_TARGETS))
        if unknown:
            return f"target_modules {unknown} (supported: {', '.join(SUPPORTED_TARGETS)})"
    return None
