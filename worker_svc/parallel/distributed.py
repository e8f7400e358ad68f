"""Tensor- and pipeline-parallel groups: rendezvous, the activation all-reduce, and the plan channel.

World rank r = stage * tensor_parallel_size + tp_rank: TP ranks of one stage are neighbours (one
node, by torchrun's and Ray's placement), stages follow each other (across nodes). Groups:
- `control`: gloo on CPU, for rank 0's command broadcasts (plans, init, reset, stop). Its timeout
  is effectively infinite because followers wait on it while the server is idle; a dead peer is
  noticed by the socket closing (gloo raises) and by rank 0 watching its children, not by timeout.
- `data`: the all-reduce of row-parallel outputs among one stage's TP ranks. NCCL on CUDA (device
  tensors); on CPU the control group itself when there is one stage, else a gloo group per stage.
- pipeline parallelism only (worker_svc/parallel/pipeline.py): `pipe`, the hidden states one stage sends the
  next (send/recv; NCCL on CUDA, gloo on CPU), and `result`, the last stage's step results to rank 0.

Invariant: `TensorParallel(size=1)` never touches torch.distributed, so TP=1 is unchanged.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
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


def cpu_threads_per_rank(size: int) -> int:
    """CPU ranks on one host share its cores instead of each grabbing all of them."""
    return max(1, (os.cpu_count() or 1) // size)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class Groups:
    """What one rank of a TP x PP world holds: its stage's TP view and the world-wide groups."""

    tp: TensorParallel
    world_rank: int
    world_size: int
    pipe_group: Any = None  # None with one stage
    result_group: Any = None
    command_group: Any = None  # rank 0's commands by send/recv (worker_svc/parallel/channels.py)


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    """Join a tensor-parallel group of `size` ranks (blocks until every rank has joined)."""
    return init_groups(rank, size, size, init_method, device).tp


def init_groups(rank: int, world_size: int, tp_size: int, init_method: str,
                device: torch.device) -> Groups:
    """Join the world of world_size = tp_size x stages ranks. One world per process. Every rank
    creates every group, in the same order (torch.distributed's rule for new_group)."""
    if dist.is_initialized():
        raise TensorParallelError("this process already belongs to a tensor-parallel group "
                                  "(close the other LLM / runner first)")
    if world_size % tp_size:
        raise TensorParallelError(f"world size {world_size} is not a multiple of tensor_parallel_size {tp_size}")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=RENDEZVOUS_TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its current device
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    stages = world_size // tp_size
    data = control if backend == "gloo" and stages == 1 else None
    for stage in range(stages):  # every rank makes every stage's group, keeps its own
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        if data is control:
            break
        group = dist.new_group(ranks=ranks, backend=backend, timeout=DATA_TIMEOUT)
        if rank in ranks:
            data = group
    pipe = result = command = None
    if stages > 1:
        pipe = dist.new_group(backend=backend, timeout=DATA_TIMEOUT)
        result = dist.new_group(backend="gloo", timeout=DATA_TIMEOUT)  # waited on only while a step is out
        command = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # followers idle on it
    tp = TensorParallel(rank=rank % tp_size, size=tp_size, data_group=data, control_group=control)
    return Groups(tp, rank, world_size, pipe, result, command)


DESTROY_TIMEOUT_S = 10.0


def destroy_group() -> None:
    """Leave the world. Bounded: tearing down gloo pairs whose peers have exited once blocked a
    TP x PP rank 0 past its stop deadline (seen once on a loaded 2-core machine); after the bound
    the process goes on (and usually exits), the group's threads are left to the OS."""
    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, daemon=True, name="destroy-group").start()
    if not done.wait(DESTROY_TIMEOUT_S):
        import logging

        logging.getLogger(__name__).warning("destroy_process_group did not return in %.0f s", DESTROY_TIMEOUT_S)


class ControlChannel:
    """Rank 0 -> every rank: pickled commands, serialised once, usually one broadcast each."""

    def __init__(self, tp: TensorParallel) -> None:
        self._group = tp.control_group  # the whole world's (every stage's ranks)
        self._buffer = torch.empty(8 + INLINE_BYTES, dtype=torch.uint8)  # [length | payload]

    def send(self, message: Any) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._buffer[:8] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")),
                                            dtype=torch.uint8)
        inline = min(len(payload), INLINE_BYTES)
        if inline:
            self._buffer[8:8 + inline] = torch.frombuffer(bytearray(payload[:inline]), dtype=torch.uint8)
        dist.broadcast(self._buffer, src=0, group=self._group)
        if len(payload) > INLINE_BYTES:
            rest = torch.frombuffer(bytearray(payload[INLINE_BYTES:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self._group)

    def flush(self) -> None:
        """Nothing to wait for: a broadcast returns once every rank has it."""

    def receive(self) -> Any:
        dist.broadcast(self._buffer, src=0, group=self._group)
        length = int.from_bytes(self._buffer[:8].numpy().tobytes(), "little")
        inline = min(length, INLINE_BYTES)
        payload = self._buffer[8:8 + inline].numpy().tobytes()
        if length > INLINE_BYTES:
            rest = torch.empty(length - INLINE_BYTES, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self._group)
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)  # noqa: S301 - from rank 0 of our own group, on loopback
