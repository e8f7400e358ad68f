"""vLLM's dynamic LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Same bodies and plain-text answers as vLLM. They change this gateway's registry only (several
gateways behind a balancer each need the call); like every /v1 route they need the API key when
one is set, and the path must be readable by this gateway and the worker alike.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.state import GatewayState
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM accepts it; the name alone identifies the adapter here


def add_lora_routes(app: FastAPI, state: GatewayState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        pools = state.pools
        pools.adapters.load(body.lora_name, body.lora_path, pools.default, (p.name for p in pools.pools))
        log.info("lora_adapter_registered", lora_name=body.lora_name, lora_path=body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        state.pools.adapters.remove(body.lora_name)
        log.info("lora_adapter_unregistered", lora_name=body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
