"""Fixtures for in-process gateway tests: a tokenizer, the fake Engine on a loopback port, and the
gateway's FastAPI app / public gRPC server wired to it (no subprocesses)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import grpc
import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.openai.api_server import create_app
from gateway.state import GatewayState
from gateway.tenancy.leases import Tenancy
from gateway.tokenizer import Tokenizer
from gateway.upstream.engine_client import EngineClient
from pagoda.runtime.grpc_health import HealthState
from pagoda.v1 import engine_pb2_grpc
from tests.gateway.fake_engine import FakeEngine

SCRIPT_TEXTS = ("Hello world. The end is near, friend.", "Another answer, quite different.")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """Only the tiny model's tokenizer files (no weights): what the gateway loads."""
    from pagoda.tools.tiny_model import PRESETS, tokenizer_config, train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(PRESETS["tiny"])))
    return str(out)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


@pytest.fixture
def scripts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=False) for text in SCRIPT_TEXTS]


@dataclass
class FakeUpstream:
    engine: FakeEngine
    target: str
    server: grpc.aio.Server


@pytest.fixture
async def upstream(tokenizer_dir, scripts):
    engine = FakeEngine(model_name=tokenizer_dir, scripts=scripts)
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    health = HealthState("pagoda.v1.Engine")
    health.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving(True)
    yield FakeUpstream(engine, f"127.0.0.1:{port}", server)
    await server.stop(0)


@dataclass
class Gateway:
    state: GatewayState
    http: httpx.AsyncClient


@pytest.fixture
async def make_gateway(upstream, tokenizer):
    """make_gateway(**GatewayConfig fields) -> Gateway connected to the fake engine; `clock`: the
    rate limiter's (tests drive time by hand)."""
    async with contextlib.AsyncExitStack() as stack:
        async def make(connect: bool = True, clock=None, **overrides) -> Gateway:
            config = GatewayConfig(scheduler=upstream.target, **overrides)
            client = EngineClient(config.scheduler, timeout_s=2.0)
            stack.push_async_callback(client.close)
            tenancy = Tenancy(config.tenant_table(), clock) if clock is not None else None
            state = GatewayState(config, client, tokenizer=tokenizer, tenancy=tenancy)
            if connect:
                await state.connect()
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)),
                                     base_url="http://gateway")
            stack.push_async_callback(http.aclose)
            return Gateway(state, http)

        yield make


@pytest.fixture
async def gateway(make_gateway) -> Gateway:
    return await make_gateway()


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (including the final [DONE])."""
    assert body.endswith("\n\n"), body[-100:]
    return [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]


async def wait_until(predicate, deadline_s: float = 20.0) -> None:
    """Poll `predicate` until true; fail after `deadline_s` (the server side notices cancels async)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not predicate():
        assert loop.time() < end, "condition not reached before the deadline"
        await asyncio.sleep(0.01)
