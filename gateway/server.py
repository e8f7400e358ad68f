"""One gateway process: uvicorn (OpenAI HTTP) and a grpc.aio server (public gRPC) on one loop."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import uvicorn
from grpc_reflection.v1alpha import reflection

from gateway.config import GatewayConfig
from gateway.drain import CountingGenerationServicer, InFlight, InFlightMiddleware
from gateway.openai.api_server import create_app
from gateway.state import GatewayState
from gateway.upstream.model_pools import pools_from_config
from pagoda.runtime.gc_tuning import freeze_long_lived_objects
from pagoda.runtime.grpc_health import HealthState
from pagoda.runtime.logging import get_logger
from pagoda.runtime.shutdown import EXIT_MARGIN_S, install_stop_handlers
from pagoda.runtime.tls import add_port, new_server
from pagoda.v1 import gateway_pb2, gateway_pb2_grpc

log = get_logger(__name__)
GENERATION_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_GRACE_S = 1.0  # after the drain: what is still running by then is cancelled


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM starts our drain instead (and the process
    then exits 0 rather than re-raising the signal)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def start_grpc_server(state: GatewayState, host: str, port: int, in_flight: InFlight | None = None
                            ) -> tuple[grpc.aio.Server, int, HealthState]:
    """Generation + grpc.health.v1 + reflection; returns (server, bound port, health)."""
    # images ride in GenerationRequest.images: up to --max-request-bytes, as over HTTP
    server = new_server([("grpc.max_receive_message_length", state.config.max_request_bytes)])
    servicer = CountingGenerationServicer(state, in_flight or InFlight())
    gateway_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = HealthState(GENERATION_SERVICE)
    health.add_to_server(server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    bound_port = add_port(server, f"{host}:{port}", state.config.tls_cert, state.config.tls_key)
    await server.start()
    await health.set_serving(False)
    return server, bound_port, health


async def _connect(state: GatewayState, health: HealthState) -> None:
    await state.connect(on_first_ready=lambda: health.set_serving(True))  # SERVING once one pool is
    # Tokenizers and FastAPI's machinery are loaded: keep the collector's full walks off them.
    freeze_long_lived_objects()


async def serve(config: GatewayConfig) -> None:
    pools = pools_from_config(config)  # one engine client (or ReplicaSet) per model pool
    state = GatewayState(config, pools=pools)
    in_flight = InFlight()
    grpc_server, grpc_port, health = await start_grpc_server(state, config.host, config.grpc_port,
                                                             in_flight)
    http = _HttpServer(uvicorn.Config(InFlightMiddleware(create_app(state), in_flight),
                                      host=config.host, port=config.port, log_level="warning",
                                      lifespan="off", access_log=False,
                                      timeout_graceful_shutdown=_GRACE_S))
    connecting = asyncio.create_task(_connect(state, health))
    stop = asyncio.Event()
    # The drain, uvicorn's and the gRPC server's grace, else the watchdog ends the process.
    install_stop_handlers(stop, config.shutdown_timeout_s + 2 * _GRACE_S + EXIT_MARGIN_S, "gateway")
    log.info("gateway_started", http=f"{config.host}:{config.port}", grpc=f"{config.host}:{grpc_port}",
             scheduler=config.scheduler)
    serving = asyncio.create_task(http.serve())
    stopping = asyncio.create_task(stop.wait())
    try:
        pending = {serving, stopping, connecting}
        while serving in pending and stopping in pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if connecting not in pending and not connecting.cancelled() and connecting.exception():
                # e.g. a tokenizer that cannot load: a gateway that can never become ready must
                # exit (and say why) rather than answer 503 forever.
                log.error("gateway_connect_failed", error=repr(connecting.exception()))
                http.should_exit = True
                await serving
                raise SystemExit(1)
        connecting.cancel()
        if stop.is_set():
            await _drain(state, health, in_flight, config.shutdown_timeout_s)
        http.should_exit = True
        await serving
    finally:
        connecting.cancel()
        await health.set_serving(False)
        await grpc_server.stop(_GRACE_S)
        await pools.close()
        log.info("gateway_stopped")


async def _drain(state: GatewayState, health: HealthState, in_flight: InFlight, timeout_s: float) -> None:
    """Not ready, refuse new work, wait for what is running (bounded by `timeout_s`)."""
    started = time.monotonic()
    state.draining = True
    await health.set_serving(False)
    log.info("gateway_draining", in_flight=in_flight.count, shutdown_timeout_s=timeout_s)
    drained = await in_flight.wait_zero(timeout_s)
    log.info("gateway_drained", drained=drained, left_in_flight=in_flight.count,
             drain_seconds=round(time.monotonic() - started, 3))
