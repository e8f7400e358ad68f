"""Faults injected into a running soak (benchmarks/soak.py --fault-schedule), against a stack whose
processes something restarts when they die: the launcher (`make run DP=2`) does, for every child.

Kinds, each aimed at one replica (a worker + scheduler pair, found by the ports they listen on):
- `worker`: SIGKILL its worker. Its scheduler preempts what ran there, re-Inits the restarted
  worker and recomputes (DESIGN.md, worker restart); its streams go on where they were.
- `scheduler`: SIGKILL its scheduler. The gateway carries its streams on on the other replica
  (mid-stream failover) and sends new requests there until the restarted scheduler serves.
- `drain`: a rolling restart of the replica, as an upgrade does it: SIGTERM its scheduler (it
  turns NOT_SERVING, the gateway routes new requests elsewhere, its requests in flight finish),
  wait until it has exited, then SIGTERM its worker (idle by then) and wait until both are back.

Each fault waits until the replica serves again (a new scheduler process SERVING with its worker
connected, and for worker and drain faults a new worker process) before the next may start; a
fault due meanwhile waits its turn. Every fault is logged with the index of the request that
triggered it, its time into the soak and how long the replica took to recover.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import grpc
import psutil

from pagoda.runtime.healthcheck import check_serving
from pagoda.v1 import engine_pb2, engine_pb2_grpc

KINDS = ("worker", "scheduler", "drain")
POLL_S = 0.1  # how often recovery is checked; each wait is bounded by the recovery timeout


@dataclass(slots=True)
class Fault:
    kind: str
    at_request: int  # fired when this request index is sent
    replica: int


@dataclass(slots=True)
class FaultEvent:
    kind: str
    replica: int
    at_request: int
    at_seconds: float  # since the soak started
    killed: dict[str, int] = field(default_factory=dict)  # process -> pid
    restarted: dict[str, int] = field(default_factory=dict)  # process -> the new pid
    drain_seconds: float | None = None  # drain: SIGTERM to the scheduler's exit
    recovered_seconds: float | None = None  # the signal to the replica serving again
    error: str = ""


def parse_schedule(text: str, every: int, kinds: str, num_requests: int, replicas: int) -> list[Fault]:
    """`kind[@replica]:request,...` (e.g. "worker:300,scheduler@1:700,drain:1100"), or with
    `every` N > 0 a fault every N requests cycling through `kinds`. Without `@`, fault j hits
    replica j mod `replicas`."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if every:
        cycle = [k.strip() for k in kinds.split(",") if k.strip()]
        entries += [f"{cycle[j % len(cycle)]}:{at}" for j, at in enumerate(range(every, num_requests, every))]
    faults = []
    for j, entry in enumerate(entries):
        what, _, at = entry.rpartition(":")
        kind, _, replica = what.partition("@")
        if kind not in KINDS or not at.isdigit():
            raise ValueError(f"fault {entry!r}: want KIND[@REPLICA]:REQUEST with KIND in {KINDS}")
        faults.append(Fault(kind, int(at), int(replica) if replica else j % replicas))
        if faults[-1].replica >= replicas:
            raise ValueError(f"fault {entry!r}: only {replicas} replica(s)")
    return sorted(faults, key=lambda f: f.at_request)


def listener_pid(port: int) -> int | None:
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def _replica_serving(scheduler_port: int) -> bool:
    target = f"127.0.0.1:{scheduler_port}"
    if not check_serving(target, timeout_s=2.0)[0]:
        return False
    with grpc.insecure_channel(target) as channel:
        try:
            stats = engine_pb2_grpc.EngineStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return stats.worker_connected


class FaultInjector:
    """Runs `faults` in order as the soak sends its requests (`sent(i)` before request i goes)."""

    def __init__(self, faults: list[Fault], replicas: list[tuple[int, int]], started: float,
                 timeout_s: float = 180.0, say: Callable[[str], None] | None = None) -> None:
        self.faults, self.replicas, self.started = faults, replicas, started  # (worker, scheduler) ports
        self.timeout_s = timeout_s
        self.events: list[FaultEvent] = []
        self._sent = -1
        self._progress = asyncio.Condition()
        self._say = say or (lambda line: print(f"[faults] {line}", file=sys.stderr, flush=True))

    async def sent(self, index: int) -> None:
        async with self._progress:
            self._sent = max(self._sent, index)
            self._progress.notify_all()

    async def run(self) -> None:
        for fault in self.faults:
            async with self._progress:
                await self._progress.wait_for(lambda f=fault: self._sent >= f.at_request)
            event = FaultEvent(fault.kind, fault.replica, fault.at_request,
                               round(time.monotonic() - self.started, 3))
            self.events.append(event)
            self._say(f"{fault.kind} on replica {fault.replica} at request {fault.at_request} "
                      f"({event.at_seconds:.1f}s)")
            try:
                await getattr(self, f"_{fault.kind}")(event, *self.replicas[fault.replica])
            except (TimeoutError, ProcessLookupError) as exc:
                event.error = f"{type(exc).__name__}: {exc}"
            self._say(f"{fault.kind} on replica {fault.replica}: {self._summary(event)}")

    @staticmethod
    def _summary(event: FaultEvent) -> str:
        if event.error:
            return f"FAILED {event.error}"
        drain = f", drained in {event.drain_seconds:.1f}s" if event.drain_seconds is not None else ""
        return f"serving again after {event.recovered_seconds:.1f}s{drain} (pids {event.killed} -> {event.restarted})"

    async def _worker(self, event: FaultEvent, worker_port: int, scheduler_port: int) -> None:
        pid = await self._pid(worker_port)
        event.killed["worker"] = pid
        signalled = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await self._back(event, signalled, {"worker": (worker_port, pid)}, scheduler_port)

    async def _scheduler(self, event: FaultEvent, worker_port: int, scheduler_port: int) -> None:
        pid = await self._pid(scheduler_port)
        event.killed["scheduler"] = pid
        signalled = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await self._back(event, signalled, {"scheduler": (scheduler_port, pid)}, scheduler_port)

    async def _drain(self, event: FaultEvent, worker_port: int, scheduler_port: int) -> None:
        scheduler, worker = await self._pid(scheduler_port), await self._pid(worker_port)
        event.killed = {"scheduler": scheduler, "worker": worker}
        signalled = time.monotonic()
        os.kill(scheduler, signal.SIGTERM)  # the drain: NOT_SERVING, requests in flight finish
        await self._until(lambda: not psutil.pid_exists(scheduler) or _zombie(scheduler), "the scheduler drained")
        event.drain_seconds = round(time.monotonic() - signalled, 3)
        os.kill(worker, signal.SIGTERM)
        await self._back(event, signalled, {"scheduler": (scheduler_port, scheduler),
                                            "worker": (worker_port, worker)}, scheduler_port)

    async def _pid(self, port: int) -> int:
        pid = await asyncio.to_thread(listener_pid, port)
        if pid is None:
            raise ProcessLookupError(f"nothing listens on port {port}")
        return pid

    async def _back(self, event: FaultEvent, signalled: float, gone: dict[str, tuple[int, int]],
                    scheduler_port: int) -> None:
        """Until each of `gone` (name -> (port, old pid)) listens again as a new process and the
        replica's scheduler serves with its worker connected."""
        for name, (port, old) in gone.items():
            def replaced(port=port, old=old, name=name) -> bool:
                pid = listener_pid(port)
                if pid is not None and pid != old:
                    event.restarted[name] = pid
                    return True
                return False
            await self._until(replaced, f"a new {name} on port {port}")
        await self._until(lambda: _replica_serving(scheduler_port), f"the scheduler on {scheduler_port} serving")
        event.recovered_seconds = round(time.monotonic() - signalled, 3)

    async def _until(self, condition: Callable[[], bool], what: str) -> None:
        end = time.monotonic() + self.timeout_s
        while not await asyncio.to_thread(condition):
            if time.monotonic() > end:
                raise TimeoutError(f"no {what} after {self.timeout_s:.0f}s")
            await asyncio.sleep(POLL_S)  # poll interval, bounded by the timeout


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def events_as_dicts(events: list[FaultEvent]) -> list[dict]:
    return [asdict(e) for e in events]
