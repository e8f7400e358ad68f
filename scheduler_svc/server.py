"""Wiring of the scheduler process: connect the worker, size the core, serve the Engine API.

Order (DESIGN.md, "Startup"): listen with health NOT_SERVING -> connect + Init the worker (retry
until it answers) -> build SchedulerConfig from its answer and the flags -> start the engine loop ->
SERVING. SIGTERM/SIGINT stop the server with a grace period.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

import grpc
from grpc_reflection.v1alpha import reflection

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.step import WorkerInfo
from pagoda.runtime.grpc_health import HealthState
from pagoda.runtime.logging import get_logger
from pagoda.runtime.shutdown import EXIT_MARGIN_S, install_stop_handlers
from pagoda.runtime.tls import add_port, new_server
from pagoda.v1 import engine_pb2, engine_pb2_grpc
from scheduler_svc.core.brownout import BrownoutConfig
from scheduler_svc.core.config import SchedulerConfig, SpeculativeConfig
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.pinned_prompts import PinnedPromptsError, resolve_pinned_prompts
from scheduler_svc.service import EngineServicer
from scheduler_svc.worker_client import WorkerClient

log = get_logger(__name__)
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


@dataclass(frozen=True, slots=True)
class EngineServiceConfig:
    """Everything the scheduler process needs; built only in `__main__` (or by tests)."""

    workers: tuple[str, ...]  # rank-0 driver of each worker group; one group is served today
    host: str = "127.0.0.1"
    port: int = 50052
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # cap below the worker's; None: the worker's
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    max_num_encoder_input_tokens: int = 0  # image rows encoded per step; 0: max_num_batched_tokens
    max_waiting_requests: int = 4096
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    admission_order: Literal["auto", "fcfs", "cached-first"] = "auto"  # core/tiers/prefill_order.py
    pipelining: bool = True  # 2 plans in flight
    worker_timeout_s: float = 30.0  # fail requests when the worker is not back within this
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long running requests may take to finish
    tls_cert: str | None = None  # PEM files of the Engine API port; None: plaintext
    tls_key: str | None = None
    tls_ca: str | None = None  # PEM CA that signed the worker's certificate; None: plaintext
    speculative: SpeculativeConfig | None = None  # n-gram speculative decoding; None: off
    brownout: BrownoutConfig | None = None  # core/brownout.py; None: off
    pinned_prompts: tuple = ()  # entries of --pinned-prompts (pinned_prompts.py), pinned at start
    # vLLM's --preemption-mode: "recompute", "swap" (needs the worker's --swap-space), None: auto
    preemption_mode: Literal["recompute", "swap"] | None = None
    tenant_kv_share: float = 1.0  # core/tenants.py: each tenant's cap, a fraction of the pool
    tenant_fairness: Literal["off", "vtc"] = "off"  # fair-share admission across tenants

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("at least one worker address is required")
        if self.worker_timeout_s <= 0:
            raise ValueError("worker_timeout_s must be positive")
        if not 0.0 < self.tenant_kv_share <= 1.0:
            raise ValueError("--tenant-kv-share must be in (0, 1]")


def inflight_steps(pipeline_parallel_size: int, pipelining: bool) -> int:
    """One plan per pipeline stage; with one stage, 2 when pipelining (the next plan goes out
    before the last result is back)."""
    if pipeline_parallel_size > 1:
        return pipeline_parallel_size
    return 2 if pipelining else 1


def scheduler_config(info: WorkerInfo, config: EngineServiceConfig) -> SchedulerConfig:
    max_model_len = min(info.max_model_len, config.max_model_len or info.max_model_len)
    return SchedulerConfig(
        num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_num_encoder_input_tokens=config.max_num_encoder_input_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        max_waiting_requests=config.max_waiting_requests, eos_token_ids=info.eos_token_ids,
        policy=config.scheduling_policy, admission_order=config.admission_order,
        max_inflight_steps=inflight_steps(info.pipeline_parallel_size, config.pipelining),
        pipeline_parallel_size=info.pipeline_parallel_size,
        speculative=config.speculative, brownout=config.brownout, max_loras=info.max_loras,
        num_cpu_blocks=info.num_cpu_blocks, preemption_mode=config.preemption_mode,
        num_offload_blocks=info.num_offload_blocks if config.enable_prefix_caching else 0,
        num_disk_blocks=info.num_disk_blocks if config.enable_prefix_caching else 0,
        sliding_window=info.sliding_window, tenant_kv_share=config.tenant_kv_share,
        tenant_fairness=config.tenant_fairness, kv_migration=info.kv_migration,
        kv_snapshots=bool(info.kv_snapshot_dir), kv_transfer_address=info.kv_transfer_address)


@dataclass(slots=True)
class RunningEngine:
    """A started scheduler server (tests use the port and the engine; `stop()` ends it)."""

    server: grpc.aio.Server
    engine: EngineLoop
    client: WorkerClient
    loop_task: asyncio.Task
    port: int
    health: HealthState | None = None

    async def stop(self, grace_s: float = 1.0) -> None:
        self.engine.stop()
        self.loop_task.cancel()
        await asyncio.gather(self.loop_task, return_exceptions=True)
        await self.server.stop(grace_s)
        await self.client.close()


async def start_engine_server(config: EngineServiceConfig) -> RunningEngine:
    # Image prompts carry their pixels (docs/vision.md): more than gRPC's 4 MiB default.
    server = new_server([("grpc.max_receive_message_length", 64 << 20)])
    servicer = EngineServicer()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    health = HealthState(SERVICE_NAME)
    health.add_to_server(server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = add_port(server, f"{config.host}:{config.port}", config.tls_cert, config.tls_key)
    await server.start()  # health answers NOT_SERVING while the worker comes up
    await health.set_serving(False)
    if len(config.workers) > 1:
        log.warning("extra_workers_ignored", used=config.workers[0], ignored=config.workers[1:])
    client = WorkerClient(config.workers[0], config.max_num_batched_tokens, config.max_num_seqs,
                          tls_ca=config.tls_ca)
    try:
        info = await client.connect(timeout_s=None)
    except BaseException:  # stopped (cancelled) while waiting for the worker, or Init refused
        await client.close()
        await server.stop(0)
        raise
    try:
        sched_config = scheduler_config(info, config)
    except ValueError:  # --preemption-mode swap, but the worker has no swap space
        await client.close()
        await server.stop(0)
        raise
    scheduler = Scheduler(sched_config)
    scheduler.restore_disk_tier(info.disk_blocks)  # the files the worker holds (kept across restarts)
    try:
        for token_ids in resolve_pinned_prompts(list(config.pinned_prompts), info.model_name):
            scheduler.pin_prompt(token_ids)  # prefilled by the first steps
    except (PinnedPromptsError, InvalidRequestError):
        await client.close()
        await server.stop(0)
        raise
    engine = EngineLoop(scheduler, client, worker_timeout_s=config.worker_timeout_s,
                        on_health=health.set_serving)
    servicer.attach(engine, info, client)
    loop_task = asyncio.create_task(engine.run(), name="engine-loop")
    await health.set_serving(True)
    log.info("scheduler_serving", address=f"{config.host}:{port}", num_blocks=sched_config.num_blocks,
             max_model_len=sched_config.max_model_len, pipelining=config.pipelining,
             num_cpu_blocks=sched_config.num_cpu_blocks, num_offload_blocks=sched_config.num_offload_blocks,
             num_disk_blocks=sched_config.num_disk_blocks, num_disk_files=len(info.disk_blocks),
             preemption_mode=config.preemption_mode or "auto")
    return RunningEngine(server, engine, client, loop_task, port, health)


async def serve(config: EngineServiceConfig, grace_s: float = 2.0) -> None:
    """Serve until SIGINT/SIGTERM, then drain and stop. Every branch returns, and the exit
    watchdog armed by the signal ends the process even if something below does not."""
    stop = asyncio.Event()
    install_stop_handlers(stop, config.shutdown_timeout_s + grace_s + EXIT_MARGIN_S, "scheduler")
    start = asyncio.create_task(start_engine_server(config), name="start-engine-server")
    stopped = asyncio.create_task(stop.wait(), name="stop-signal")
    try:
        await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # stopped while still waiting for the worker: its server stops too
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            log.info("scheduler_stopped", served=False)
            return
        running = start.result()  # raises what failed the start-up (address in use...)
        await stopped
    finally:
        stopped.cancel()
    await drain(running, config.shutdown_timeout_s)
    log.info("scheduler_stopping")
    try:  # bounded: the watchdog is the last resort, not the plan
        await asyncio.wait_for(running.stop(grace_s), grace_s + EXIT_MARGIN_S / 2)
    except TimeoutError:
        log.error("scheduler_stop_timed_out", bound_s=grace_s + EXIT_MARGIN_S / 2)
    log.info("scheduler_stopped", served=True)


async def drain(running: RunningEngine, timeout_s: float) -> None:
    """SIGTERM: NOT_SERVING, new requests UNAVAILABLE, running ones finish (bounded by timeout_s)."""
    started = time.monotonic()
    running.engine.draining = True
    if running.health is not None:
        await running.health.set_serving(False)
    log.info("scheduler_draining", shutdown_timeout_s=timeout_s)
    deadline = started + timeout_s
    while not running.engine.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # poll interval; bounded by the deadline
    log.info("scheduler_drained", drained=running.engine.idle,
             drain_seconds=round(time.monotonic() - started, 3))
