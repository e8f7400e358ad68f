"""What the gateway knows about its upstream: the engine client, the scheduler's info, the tokenizer.

The servers start before the scheduler answers; `connect()` fills the rest in, and every request
before that gets 503 (EngineNotReadyError).
"""

from __future__ import annotations

import asyncio
import os

from gateway import metrics
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.errors import EngineNotReadyError, ModelNotFoundError
from gateway.tenancy import Tenancy
from gateway.tokenizer import Tokenizer
from pagoda.runtime.logging import get_logger
from pagoda.v1 import engine_pb2

log = get_logger(__name__)


class GatewayState:
    def __init__(self, config: GatewayConfig, client: EngineClient,
                 tokenizer: Tokenizer | None = None, tenancy: Tenancy | None = None) -> None:
        self.config = config
        self.client = client
        self.tenancy = tenancy or Tenancy(config.tenant_table())  # keys, tenants and their limits
        self.tokenizer = tokenizer
        self.info: engine_pb2.EngineInfo | None = None
        self.served_model_name = config.served_model_name or ""
        self.draining = False  # SIGTERM: refuse new work while in-flight requests finish

    @property
    def ready(self) -> bool:
        return not self.draining and self.info is not None and self.tokenizer is not None

    async def connect(self, attempt_timeout_s: float = 5.0) -> None:
        """Wait for the scheduler's GetInfo (retrying forever), then load the tokenizer."""
        while self.info is None:
            try:
                info = await self.client.wait_for_info(attempt_timeout_s)
            except Exception as error:  # noqa: BLE001 - keep trying until the scheduler is up
                log.info("scheduler_not_ready", target=self.client.target, error=str(error))
                continue
            if self.tokenizer is None:
                path = self.config.tokenizer or info.model_name
                self.tokenizer = await asyncio.to_thread(Tokenizer.load, path)
                log.info("tokenizer_loaded", path=path)
            self.served_model_name = self.config.served_model_name or info.model_name
            metrics.METRICS.model_name = self.served_model_name  # the model_name label
            self.info = info  # last: `ready` flips only once everything above is in place
            log.info("scheduler_connected", target=self.client.target, model=self.served_model_name,
                     max_model_len=info.max_model_len)

    def require_ready(self) -> tuple[Tokenizer, engine_pb2.EngineInfo]:
        if self.draining:
            raise EngineNotReadyError("the gateway is shutting down; retry on another replica")
        if self.tokenizer is None or self.info is None:
            raise EngineNotReadyError("the scheduler is not available yet; retry shortly")
        return self.tokenizer, self.info

    def check_model(self, model: str | None) -> str:
        """The served name; 404 for any other non-empty model (vLLM's message)."""
        if model and model not in (self.served_model_name, os.path.basename(self.served_model_name)):
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
        return self.served_model_name
