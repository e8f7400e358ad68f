"""Pipeline parallelism: which layers a stage holds, and what passes between stages.

The decoder's layers split into `size` contiguous stages (vLLM's `get_pp_indices` split: even,
the remainder to the last stages, which hold no embedding). Stage 0 embeds the tokens, the last
stage applies the final norm and the LM head and samples. Every stage applies every plan to its own
copy of the resident state (as TP followers do) and holds only its layers' KV, at the same block ids.

Per step with scheduled tokens, rank (stage s, tp t) receives the hidden states [T, hidden] from
(s-1, t) and sends its output to (s+1, t). The last stage's TP rank 0 sends rank 0 each step's
result (pickled StepResult, every step, empty ones too), so rank 0 reports it to the scheduler.

Invariant: `SINGLE_STAGE` (size 1) never touches torch.distributed.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagoda.contract.step import StepResult


class PipelineError(ValueError):
    """A pipeline-parallel degree this model or setting cannot take."""


def partition_layers(num_layers: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: an even split, the last stages one more when uneven."""
    if not 1 <= size <= num_layers:
        raise PipelineError(f"pipeline_parallel_size {size} must be between 1 and the model's "
                            f"{num_layers} layers (each stage holds at least one layer)")
    base, extra = divmod(num_layers, size)
    bounds, start = [], 0
    for stage in range(size):
        end = start + base + (1 if stage >= size - extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True, slots=True)
class PipelineStage:
    index: int = 0
    size: int = 1
    start_layer: int = 0
    end_layer: int | None = None  # None: every layer (one stage)
    tp_size: int = 1
    world_rank: int = 0
    pipe_group: Any = None
    result_group: Any = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        return range(self.start_layer, num_layers if self.end_layer is None else self.end_layer)

    def holds_layer(self, layer: int) -> bool:
        return self.start_layer <= layer and (self.end_layer is None or layer < self.end_layer)

    # -- hidden states, stage to stage ----------------------------------------------------------

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)  # [T, hidden]
        dist.recv(hidden, src=self.world_rank - self.tp_size, group=self.pipe_group)
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), dst=self.world_rank + self.tp_size, group=self.pipe_group)

    # -- the last stage's results, to rank 0 ----------------------------------------------------

    def send_result(self, result: StepResult) -> None:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst=0, group=self.result_group)
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=self.result_group)

    def recv_result(self) -> StepResult:
        """Rank 0: the next step's result from the last stage's TP rank 0 (steps in order)."""
        src = (self.size - 1) * self.tp_size
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, src=src, group=self.result_group)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(payload, src=src, group=self.result_group)
        return pickle.loads(payload.numpy().tobytes())  # noqa: S301 - our own group's last stage


SINGLE_STAGE = PipelineStage()


def stage_of(world_rank: int, tp_size: int, pp_size: int, num_layers: int,
             pipe_group: Any = None, result_group: Any = None) -> PipelineStage:
    index = world_rank // tp_size
    start, end = partition_layers(num_layers, pp_size)[index]
    return PipelineStage(index, pp_size, start, end if pp_size > 1 else None, tp_size, world_rank,
                         pipe_group, result_group)
