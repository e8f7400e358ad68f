"""`LoRAManager`: the adapters of a worker, on the host and in the device slots.

- Host: an LRU of loaded adapters (`max_cpu_loras`), so an adapter that left its slot comes back
  with one copy, not a disk read.
- Device: `max_loras` slots per projection. Each step, `prepare` makes sure every adapter of the
  step's sequences has a slot (evicting the least recently used slot no sequence of this step needs)
  and builds the step's LoRABatch. The scheduler never runs more than `max_loras` distinct adapters
  at once (scheduler_svc/core/admission.py), so a step always fits.

Under tensor parallelism every rank runs its own manager over its shard (weights.py splits the
adapters like the base weights); the ranks apply the same plans, so they fill the same slots.

Adapters are keyed by `LoRARequest.cache_key` (name and path), never by the request's int id, which
only the caller that chose it knows.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagoda.contract.lora import LoRARequest
from pagoda.runtime.logging import get_logger
from worker_svc.input_batch import ScheduledSeq
from worker_svc.lora.layers import LoRABatch, LoRALinear, build_lora_batch
from worker_svc.lora.weights import AdapterWeights, fused_shapes, load_adapter
from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.models.llama import MissingLayer
from worker_svc.parallel.distributed import SINGLE, TensorParallel

log = get_logger(__name__)

# (parent module attribute, projection attribute, fused projection name) of each decoder layer
_PROJECTIONS = (("self_attn", "qkv_proj", "qkv"), ("self_attn", "o_proj", "o"),
                ("mlp", "gate_up_proj", "gate_up"), ("mlp", "down_proj", "down"))


class LoRAManager:
    def __init__(self, model: nn.Module, cfg: ModelConfig, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:  # vLLM's rule too
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        if cfg.num_experts:  # the experts are stacked tensors, not the Linear layers LoRA wraps
            raise ValueError(f"LoRA is not supported on mixture-of-experts models ({cfg.architecture})")
        self.cfg, self.dtype, self.device, self.tp = cfg, dtype, device, tp
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.batch: LoRABatch | None = None  # the current step's; read by every LoRALinear
        self.layers = self._wrap(model)
        self._host: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._slot_keys: list[str | None] = [None] * max_loras
        self._slot_targets: list[frozenset[str]] = [frozenset()] * max_loras
        self._slot_used = [0] * max_loras  # the step counter when each slot was last needed
        self._clock = itertools.count(1)

    def _wrap(self, model: nn.Module) -> list[LoRALinear]:
        shapes = fused_shapes(self.cfg, self.tp.size)  # this rank's share of each projection
        wrapped = []
        for index, layer in enumerate(model.model.layers):
            if isinstance(layer, MissingLayer):  # another pipeline stage's layer
                continue
            for parent_name, attr, proj in _PROJECTIONS:
                parent = getattr(layer, parent_name)
                shape = shapes[proj]
                module = LoRALinear(getattr(parent, attr), proj, index, shape.in_features, shape.sub_out,
                                    self.max_lora_rank, self.max_loras, self, self.dtype, self.device)
                setattr(parent, attr, module)
                wrapped.append(module)
        return wrapped

    # -- per step -------------------------------------------------------------------------------

    def prepare(self, seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Slot every adapter of the step, set `self.batch`, and return `seqs` grouped by slot
        (base-model sequences first, order kept within a group), the order the step must run in:
        each adapter's tokens are then one contiguous block of rows, which the delta reads and
        writes through views (layers.py). Callers match results by request id, never by order."""
        needed = {s.state.lora.cache_key: s.state.lora for s in seqs if s.state.lora is not None}
        if not needed:
            self.batch = None
            return seqs
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} LoRA adapters but --max-loras is "
                               f"{self.max_loras} (the scheduler should never plan it)")
        now = next(self._clock)
        slot_of = {key: self._slot_for(key, lora, needed, now) for key, lora in needed.items()}
        seq_slots = [slot_of[s.state.lora.cache_key] if s.state.lora is not None else -1 for s in seqs]
        order = sorted(range(len(seqs)), key=seq_slots.__getitem__)  # stable
        seqs = [seqs[i] for i in order]
        token_slots = np.repeat(np.asarray([seq_slots[i] for i in order], dtype=np.int64),
                                np.asarray([s.num_tokens for s in seqs], dtype=np.int64))
        targets = frozenset().union(*(self._slot_targets[s] for s in slot_of.values()))
        self.batch = build_lora_batch(token_slots, targets, self.device)
        return seqs

    def finish_step(self) -> None:
        self.batch = None

    # -- slots and the host cache ---------------------------------------------------------------

    def _slot_for(self, key: str, lora: LoRARequest, needed: dict[str, LoRARequest], now: int) -> int:
        if key in self._slot_keys:
            slot = self._slot_keys.index(key)
        else:
            free = [s for s, k in enumerate(self._slot_keys) if k is None or k not in needed]
            slot = min(free, key=lambda s: (self._slot_keys[s] is not None, self._slot_used[s]))
            self._fill_slot(slot, key, self._host_weights(lora))
        self._slot_used[slot] = now
        return slot

    def _fill_slot(self, slot: int, key: str, weights: AdapterWeights) -> None:
        for module in self.layers:
            pair = weights.matrices.get((module.layer, module.proj))
            if pair is None:
                module.lora_a[slot].zero_()
                module.lora_b[slot].zero_()
            else:
                module.lora_a[slot].copy_(pair[0], non_blocking=True)
                module.lora_b[slot].copy_(pair[1], non_blocking=True)
        self._slot_keys[slot] = key
        self._slot_targets[slot] = weights.targets

    def _host_weights(self, lora: LoRARequest) -> AdapterWeights:
        key = lora.cache_key
        weights = self._host.get(key)
        if weights is not None:
            self._host.move_to_end(key)
            return weights
        weights = load_adapter(lora.lora_path, self.cfg, self.max_lora_rank, self.dtype,
                               self.tp.rank, self.tp.size)
        log.info("lora_adapter_loaded", lora_name=lora.lora_name, lora_path=lora.lora_path,
                 targets=sorted(weights.targets))
        self._host[key] = weights
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return weights

    @property
    def resident_adapters(self) -> list[str]:
        """Names (cache keys) of the adapters in device slots."""
        return [k for k in self._slot_keys if k is not None]
