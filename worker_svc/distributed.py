"""Tensor-parallel group: rendezvous, the activation all-reduce, and the plan channel.

Two process groups over the same ranks (SGLang's split):
- `control`: gloo on CPU, for rank 0's command broadcasts (plans, init, reset, stop). Its timeout
  is effectively infinite because followers wait on it while the server is idle; a dead peer is
  noticed by the socket closing (gloo raises) and by rank 0 watching its children, not by timeout.
- `data`: the all-reduce of row-parallel outputs. NCCL on CUDA (device tensors), and the control
  group itself on CPU (gloo), so CPU runs need one group only.

Invariant: `TensorParallel(size=1)` never touches torch.distributed, so TP=1 is unchanged.
"""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

RENDEZVOUS_TIMEOUT = timedelta(seconds=120)  # every rank must join within this
DATA_TIMEOUT = timedelta(minutes=10)  # a collective inside a forward never waits this long
CONTROL_TIMEOUT = timedelta(days=365)  # followers idle here between requests
# One broadcast carries the 8-byte length and a plan of up to this many bytes; a bigger message
# (a batch of long new prompts) follows in a second broadcast of exactly the remainder.
INLINE_BYTES = 8192


class TensorParallelError(RuntimeError):
    """The group cannot work: a bad degree for this model, or a rank that died."""


@dataclass(slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    data_group: Any = None  # dist.ProcessGroup; None when size == 1
    control_group: Any = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (a row-parallel layer's partial products)."""
        dist.all_reduce(x, group=self.data_group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """Every rank must size its KV cache alike: take the smallest block count."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())


SINGLE = TensorParallel()


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int,
                    moe_intermediate_size: int = 0) -> None:
    """Heads and MLP (and experts') columns are split evenly; raise a clear error when they cannot be."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {size}")
    for name, value in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                        ("intermediate_size", intermediate_size),
                        ("moe_intermediate_size", moe_intermediate_size)):
        if value % size:
            raise TensorParallelError(
                f"tensor_parallel_size {size} must divide the model's {name} ({value}): each rank "
                f"holds {name}/tensor_parallel_size of them")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    """Join the group (blocks until every rank has joined). One group per process."""
    if dist.is_initialized():
        raise TensorParallelError("this process already belongs to a tensor-parallel group "
                                  "(close the other LLM / runner first)")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=RENDEZVOUS_TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its current device
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    data = dist.new_group(backend="nccl", timeout=DATA_TIMEOUT) if device.type == "cuda" else control
    return TensorParallel(rank=rank, size=size, data_group=data, control_group=control)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class ControlChannel:
    """Rank 0 -> every rank: pickled commands, serialised once, usually one broadcast each."""

    def __init__(self, tp: TensorParallel) -> None:
        self._tp = tp
        self._buffer = torch.empty(8 + INLINE_BYTES, dtype=torch.uint8)  # [length | payload]

    def send(self, message: Any) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._buffer[:8] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")),
                                            dtype=torch.uint8)
        inline = min(len(payload), INLINE_BYTES)
        if inline:
            self._buffer[8:8 + inline] = torch.frombuffer(bytearray(payload[:inline]), dtype=torch.uint8)
        dist.broadcast(self._buffer, src=0, group=self._tp.control_group)
        if len(payload) > INLINE_BYTES:
            rest = torch.frombuffer(bytearray(payload[INLINE_BYTES:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self._tp.control_group)

    def receive(self) -> Any:
        dist.broadcast(self._buffer, src=0, group=self._tp.control_group)
        length = int.from_bytes(self._buffer[:8].numpy().tobytes(), "little")
        inline = min(length, INLINE_BYTES)
        payload = self._buffer[8:8 + inline].numpy().tobytes()
        if length > INLINE_BYTES:
            rest = torch.empty(length - INLINE_BYTES, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self._tp.control_group)
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)  # noqa: S301 - from rank 0 of our own group, on loopback
