"""Wiring of the worker's grpc.aio server: servicer, health, reflection, graceful shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from grpc_reflection.v1alpha import reflection

from pagoda.runtime.grpc_health import HealthState
from pagoda.runtime.logging import get_logger
from pagoda.runtime.shutdown import EXIT_MARGIN_S, install_stop_handlers
from pagoda.runtime.tls import add_port, new_server
from pagoda.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker_svc.kv_transfer.service import KvTransferServicer
from worker_svc.service import StepRunner, WorkerServicer

log = get_logger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
KV_TRANSFER_NAME = kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name
# Plans with big prompts and results with logprobs can pass the 4 MB default.
MESSAGE_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]


def bind_worker_server(host: str, port: int, tls_cert: str | None = None,
                       tls_key: str | None = None) -> tuple[grpc.aio.Server, int]:
    """A server holding its port, not yet serving; returns (server, bound port). The worker binds
    before it loads the model: a taken port fails at once, and nothing started meanwhile (a
    tensor-parallel group's sockets take ephemeral ports) can take the port asked for."""
    server = new_server(MESSAGE_OPTIONS)
    return server, add_port(server, f"{host}:{port}", tls_cert, tls_key)


async def start_worker_server(runner: StepRunner, host: str, port: int, tls_cert: str | None = None,
                              tls_key: str | None = None,
                              bound: tuple[grpc.aio.Server, int] | None = None,
                              ) -> tuple[grpc.aio.Server, WorkerServicer, int]:
    """Start serving (health NOT_SERVING until Init) on `bound` (from bind_worker_server) or a
    server bound now; returns (server, servicer, bound port)."""
    server, bound_port = bound or bind_worker_server(host, port, tls_cert, tls_key)
    health = HealthState(SERVICE_NAME)
    servicer = WorkerServicer(runner, health)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferServicer(runner), server)  # --kv-transfer grpc
    health.add_to_server(server)
    reflection.enable_server_reflection((SERVICE_NAME, KV_TRANSFER_NAME, reflection.SERVICE_NAME), server)
    await server.start()
    await health.set_serving(False)
    log.info("worker_listening", address=f"{host}:{bound_port}")
    return server, servicer, bound_port


async def serve(build_runner: Callable[[], StepRunner], host: str, port: int, grace_s: float = 2.0,
                tls_cert: str | None = None, tls_key: str | None = None) -> None:
    """Bind, build the runner (the model load), then serve until SIGTERM/SIGINT."""
    bound = bind_worker_server(host, port, tls_cert, tls_key)
    runner = build_runner()
    server, servicer, _ = await start_worker_server(runner, host, port, bound=bound)
    stop = asyncio.Event()
    # No drain here (the scheduler drains); the bound covers the grace, a step still running and
    # a tensor-parallel group's stop (atexit), else the watchdog ends the process.
    install_stop_handlers(stop, grace_s + EXIT_MARGIN_S, "worker")
    await stop.wait()
    log.info("worker_stopping")
    try:
        await asyncio.wait_for(server.stop(grace_s), grace_s + EXIT_MARGIN_S / 2)
    except TimeoutError:
        log.error("worker_stop_timed_out", bound_s=grace_s + EXIT_MARGIN_S / 2)
    servicer.close()
    log.info("worker_stopped")
