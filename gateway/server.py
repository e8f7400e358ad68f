"""One gateway process: uvicorn (OpenAI HTTP) and a grpc.aio server (public gRPC) on one loop."""

from __future__ import annotations

import asyncio

import grpc
import uvicorn
from grpc_reflection.v1alpha import reflection

from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.grpc_api import GenerationServicer
from gateway.openai_api import create_app
from gateway.state import GatewayState
from pagoda.grpc_health import HealthState
from pagoda.logging import get_logger
from pagoda.v1 import gateway_pb2, gateway_pb2_grpc

log = get_logger(__name__)
GENERATION_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_GRACE_S = 5.0


async def start_grpc_server(state: GatewayState, host: str, port: int
                            ) -> tuple[grpc.aio.Server, int, HealthState]:
    """Generation + grpc.health.v1 + reflection; returns (server, bound port, health)."""
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(state), server)
    health = HealthState(GENERATION_SERVICE)
    health.add_to_server(server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    bound_port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health.set_serving(False)
    return server, bound_port, health


async def _connect(state: GatewayState, health: HealthState) -> None:
    await state.connect()
    await health.set_serving(True)


async def serve(config: GatewayConfig) -> None:
    client = EngineClient(config.scheduler, config.engine_timeout_s)
    state = GatewayState(config, client)
    grpc_server, grpc_port, health = await start_grpc_server(state, config.host, config.grpc_port)
    http = uvicorn.Server(uvicorn.Config(create_app(state), host=config.host, port=config.port,
                                         log_level="warning", lifespan="off", access_log=False))
    connecting = asyncio.create_task(_connect(state, health))
    log.info("gateway_started", http=f"{config.host}:{config.port}", grpc=f"{config.host}:{grpc_port}",
             scheduler=config.scheduler)
    try:
        await http.serve()  # returns on SIGINT / SIGTERM (uvicorn handles the signals)
    finally:
        connecting.cancel()
        await health.set_serving(False)
        await grpc_server.stop(_GRACE_S)
        await client.close()
        log.info("gateway_stopped")
