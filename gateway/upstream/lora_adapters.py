"""LoRA adapters as models: the gateway's registry of adapter names, and the pool an adapter resolves to.

An adapter is served by its base model's pool (vLLM's rule: the OpenAI `model` field names the
adapter). `ModelPools.resolve()` turns an adapter name into an `AdapterPool`: the base pool under
the adapter's name, whose client stamps the adapter onto every Engine GenerateRequest. So the
request handlers, the fallback and the metrics need no LoRA code at all; the reply's `model` is the
adapter's name, and /v1/models lists each adapter with `parent` = its base model.

Static adapters come from `--lora-modules name=path`; `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (vLLM's bodies) change the registry at run time. Each adapter's
adapter_config.json is checked here (the worker reads the same path), its rank against the
worker's --max-lora-rank once the pool is connected.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.errors import ModelNotFoundError
from pagoda.contract.common_codec import lora_to_pb
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.lora import LoRARequest, read_adapter_config


def parse_lora_module(spec: str) -> tuple[str, str]:
    """`name=path` (vLLM's --lora-modules form) -> (name, path)."""
    name, equals, path = spec.partition("=")
    if not equals or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes name=path entries, got {spec!r}")
    return name.strip(), path.strip()


@dataclass(frozen=True, slots=True)
class Adapter:
    lora: LoRARequest
    base_model: str | None  # the pool serving it; None: the default pool


class LoRARegistry:
    def __init__(self, modules: Iterable[tuple[str, str]] = ()) -> None:
        self._adapters: dict[str, Adapter] = {}
        self._ids = itertools.count(1)  # vLLM's lora_int_id: unique per registration
        self._rank_checked: set[str] = set()  # adapter names whose rank fits their worker
        for name, path in modules:
            self.add(name, path)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def __iter__(self):
        return iter(self._adapters.values())

    def add(self, name: str, path: str, base_model: str | None = None) -> Adapter:
        """InvalidRequestError for a taken name or an adapter directory Pagoda cannot serve."""
        if name in self._adapters:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.")
        read_adapter_config(path)
        adapter = Adapter(LoRARequest(name, next(self._ids), path), base_model)
        self._adapters[name] = adapter
        return adapter

    def load(self, name: str, path: str, base, taken: Iterable[str]) -> Adapter:
        """POST /v1/load_lora_adapter: registered for the `base` pool once its worker can serve it."""
        if name in set(taken):
            raise InvalidRequestError(f"'{name}' is already the name of a served model")
        _, info = base.require_ready()  # 503 before the scheduler answered: its limits are unknown
        adapter = self.add(name, path)
        try:
            self.check_servable(adapter, info)
        except InvalidRequestError:
            self.remove(name)
            raise
        return adapter

    def remove(self, name: str) -> None:
        if self._adapters.pop(name, None) is None:
            raise ModelNotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self._rank_checked.discard(name)

    def check_servable(self, adapter: Adapter, info) -> None:
        """400 when the base model's worker runs without LoRA or below the adapter's rank."""
        if not info.max_loras:
            raise InvalidRequestError(f"model {adapter.lora.lora_name!r} is a LoRA adapter, but the "
                                      "worker runs without --enable-lora")
        name = adapter.lora.lora_name
        if name not in self._rank_checked:
            read_adapter_config(adapter.lora.lora_path, info.max_lora_rank)
            self._rank_checked.add(name)


class AdapterClient:
    """The base pool's engine client, stamping the adapter onto each GenerateRequest."""

    def __init__(self, client, lora: LoRARequest) -> None:
        self._client = client
        self._lora_pb = lora_to_pb(lora)

    def generate(self, request, metadata=()):
        request.lora.CopyFrom(self._lora_pb)
        return self._client.generate(request, metadata=metadata)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


class AdapterPool:
    """The base pool, seen under the adapter's name (what ModelPools.resolve returns for it)."""

    def __init__(self, adapter: Adapter, base, registry: LoRARegistry) -> None:
        self.adapter, self.base, self._registry = adapter, base, registry
        self.name = adapter.lora.lora_name
        self.client = AdapterClient(base.client, adapter.lora)

    tokenizer = property(lambda self: self.base.tokenizer)
    info = property(lambda self: self.base.info)
    ready = property(lambda self: self.base.ready)
    in_rotation = property(lambda self: self.base.in_rotation)

    def answers_to(self, model: str) -> bool:
        return model == self.name

    def require_ready(self):
        tokenizer, info = self.base.require_ready()
        self._registry.check_servable(self.adapter, info)
        return tokenizer, info

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "pagoda",
                "root": self.adapter.lora.lora_path, "parent": self.base.name,
                "max_model_len": self.base.info.max_model_len if self.base.info else None,
                "permission": []}
