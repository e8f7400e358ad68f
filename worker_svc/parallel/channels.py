"""Rank 0's commands (init, reset, step, stop) to every other rank: which channel a world uses.

One stage: the ControlChannel's broadcast (worker_svc/parallel/distributed.py): every rank is in
every step, so waiting for all of them costs nothing.

Several stages: a broadcast would make rank 0 wait until the LAST stage, still computing step k,
reaches its receive: stage 0 could never start step k+1 early, and the pipeline would never fill.
So rank 0 sends each command to each rank with `isend` (length, then pickled payload) and goes on;
a rank receives them in order (gloo keeps the order of one sender's messages to one receiver on one
group and tag). The buffers live until their sends complete.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from worker_svc.parallel.distributed import ControlChannel, Groups

FLUSH_TIMEOUT_S = 10.0


class PointToPointChannel:
    def __init__(self, group: Any, world_size: int) -> None:
        self._group = group
        self._peers = range(1, world_size)
        self._pending: list[tuple[list, torch.Tensor, torch.Tensor]] = []  # (works, length, payload)

    def send(self, message: Any) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        works = []
        for peer in self._peers:
            works.append(dist.isend(length, dst=peer, group=self._group))
            works.append(dist.isend(data, dst=peer, group=self._group))
        self._pending = [p for p in self._pending if not all(w.is_completed() for w in p[0])]
        self._pending.append((works, length, data))

    def receive(self) -> Any:
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, src=0, group=self._group)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(data, src=0, group=self._group)
        return pickle.loads(data.numpy().tobytes())  # noqa: S301 - rank 0 of our own world

    def flush(self) -> None:
        """Wait until every command sent so far reached its rank (before leaving the world)."""
        from datetime import timedelta

        for works, _, _ in self._pending:
            for work in works:
                work.wait(timedelta(seconds=FLUSH_TIMEOUT_S))
        self._pending = []


def command_channel(groups: Groups) -> ControlChannel | PointToPointChannel:
    if groups.command_group is None:
        return ControlChannel(groups.tp)
    return PointToPointChannel(groups.command_group, groups.world_size)
