"""What the gateway knows about its upstream: the model pools (each one's engine client, scheduler
info and tokenizer) and the tenants.

The servers start before the schedulers answer; `connect()` fills the rest in, and every request
for a pool before that gets 503 (EngineNotReadyError).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gateway.config import GatewayConfig
from gateway.errors import EngineNotReadyError
from gateway.tenancy.leases import Tenancy
from gateway.tokenizer import Tokenizer
from gateway.upstream.engine_client import EngineClient
from gateway.upstream.lora_adapters import LoRARegistry
from gateway.upstream.model_pools import ModelPool, ModelPools, Route
from gateway.upstream.replica_set import ReplicaSet
from pagoda.v1 import engine_pb2


class GatewayState:
    def __init__(self, config: GatewayConfig, client: EngineClient | ReplicaSet | None = None,
                 tokenizer: Tokenizer | None = None, tenancy: Tenancy | None = None,
                 pools: ModelPools | None = None) -> None:
        """`pools`, or one pool of `client` (named by config.served_model_name, tokenizer
        config.tokenizer unless `tokenizer` is given loaded)."""
        self.config = config
        self.pools = pools or ModelPools([ModelPool(config.served_model_name, client, config.tokenizer, tokenizer)],
                                         dict(config.fallback_models), LoRARegistry(config.lora_modules))
        self.tenancy = tenancy or Tenancy(config.tenant_table())  # keys, tenants and their limits
        self.draining = False  # SIGTERM: refuse new work while in-flight requests finish

    # The default pool's, for callers that know one model only.
    @property
    def client(self) -> EngineClient | ReplicaSet:
        return self.pools.default.client

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.pools.default.tokenizer

    @property
    def info(self) -> engine_pb2.EngineInfo | None:
        return self.pools.default.info

    @property
    def served_model_name(self) -> str:
        return self.pools.default.name

    @property
    def ready(self) -> bool:
        return not self.draining and self.pools.ready

    async def connect(self, on_first_ready: Callable[[], Awaitable[None]] | None = None) -> None:
        """Wait for every pool's scheduler (GetInfo, retrying forever) and tokenizer;
        `on_first_ready` runs as soon as one pool can serve."""
        await self.pools.connect(on_first_ready)

    def route(self, model: str | None) -> Route:
        """The pools a generation request for `model` may be served by (404 for an unknown model)."""
        self._refuse_while_draining()
        return self.pools.route(model)

    def pool(self, model: str | None) -> ModelPool:
        """The pool `model` names, ready (404 unknown, 503 not connected yet or draining)."""
        self._refuse_while_draining()
        pool = self.pools.resolve(model)
        pool.require_ready()
        return pool

    def require_ready(self) -> tuple[Tokenizer, engine_pb2.EngineInfo]:
        self._refuse_while_draining()
        return self.pools.default.require_ready()

    def check_model(self, model: str | None) -> str:
        """The name of the pool `model` names; 404 for a model no pool serves."""
        return self.pools.resolve(model).name

    def _refuse_while_draining(self) -> None:
        if self.draining:
            raise EngineNotReadyError("the gateway is shutting down; retry on another replica")
