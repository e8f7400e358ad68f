"""What one Generate call reads from the engine loop: a queue of StreamUpdates for its request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagoda.contract.ids import RequestId
from pagoda.v1 import common_pb2
from scheduler_svc.core.outputs import SequenceDelta


@dataclass(slots=True)
class StreamUpdate:
    deltas: list[SequenceDelta]
    finished: bool  # every sequence of the request has finished: the last update
    queue_seconds: float = 0.0  # arrival to first scheduled; set on the first update only
    timings: common_pb2.RequestTimings | None = None  # set on the last update only


@dataclass(slots=True)
class RequestStream:
    """What a Generate call reads: StreamUpdates, or an exception that ends the call."""

    request_id: RequestId
    n: int
    arrival: float  # time.monotonic()
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_finished: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None  # when its first token reached the loop (time.monotonic())
    sent_first: bool = False
    done: bool = False
