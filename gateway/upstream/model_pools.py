"""Model pools: which schedulers serve which model, and which pool a request's `model` picks.

`--scheduler` entries are `[MODEL=]HOST:PORT`. Entries without a name form the default pool, named
by --served-model-name or else by the model path its scheduler reports; each named entry joins the
pool of that name. A pool of one scheduler is an EngineClient, of several a ReplicaSet (routing,
breakers, failover inside the pool); with more than one pool every pool is a ReplicaSet, so each
scheduler has a breaker and a `pagoda:replica_up` series (labels: positions in --scheduler). A
`dns://` entry is a ReplicaSet whose replicas are the name's addresses (labels: the addresses).

`ModelPools.resolve()` is the one place a request's `model` becomes a pool (an unknown one is a 404);
`route()` adds the fallback (`--fallback-model A=B`): B answers when A's pool is unavailable (never
connected, or every replica out of rotation), and B is tried next when A refuses the request before
its first token (gateway/upstream/fallback.py). /v1/models lists every pool (`cards()`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway import metrics
from gateway.config import GatewayConfig
from gateway.errors import EngineNotReadyError, ModelNotFoundError, UpstreamError
from gateway.tokenizer import Tokenizer
from gateway.upstream.dns_discovery import DnsDiscovery, is_dns_target, parse_dns_target
from gateway.upstream.engine_client import EngineClient
from gateway.upstream.lora_adapters import AdapterPool, LoRARegistry
from gateway.upstream.replica_set import ReplicaSet
from pagoda.runtime.logging import get_logger
from pagoda.v1 import engine_pb2

log = get_logger(__name__)
# Pools load their tokenizers in threads; transformers' lazy imports are not thread-safe (two at
# once: "cannot import name 'AutoTokenizer'"), so one load at a time.
_TOKENIZER_LOADING = threading.Lock()


def _load_tokenizer(path: str) -> Tokenizer:
    with _TOKENIZER_LOADING:
        return Tokenizer.load(path)


class ModelPool:
    """The schedulers serving one model, behind one client, with that model's tokenizer and info."""

    def __init__(self, name: str | None, client: EngineClient | ReplicaSet, tokenizer_path: str | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.name = name or ""  # "" until GetInfo names the default pool
        self._named = name is not None
        self.client = client
        self.tokenizer_path = tokenizer_path  # None: the model path the scheduler reports
        self.tokenizer = tokenizer
        self.info: engine_pb2.EngineInfo | None = None

    @property
    def ready(self) -> bool:
        return self.info is not None and self.tokenizer is not None

    @property
    def in_rotation(self) -> bool:
        """Connected, and (several replicas) at least one replica's breaker is closed."""
        replicas = getattr(self.client, "replicas", None)
        return self.ready and (replicas is None or any(r.breaker.closed and r.in_set for r in replicas))

    def answers_to(self, model: str) -> bool:
        return bool(self.name) and model in (self.name, os.path.basename(self.name))

    def require_ready(self) -> tuple[Tokenizer, engine_pb2.EngineInfo]:
        if self.tokenizer is None or self.info is None:
            which = f"the scheduler of model {self.name!r}" if self.name else "the scheduler"
            raise EngineNotReadyError(f"{which} is not available yet; retry shortly")
        return self.tokenizer, self.info

    async def connect(self, attempt_timeout_s: float = 5.0) -> None:
        """Wait for a scheduler's GetInfo (retrying forever), then load the tokenizer."""
        while self.info is None:
            try:
                info = await self.client.wait_for_info(attempt_timeout_s)
            except Exception as error:  # noqa: BLE001 - keep trying until the scheduler is up
                log.info("scheduler_not_ready", target=self.client.target, error=str(error))
                continue
            if self.tokenizer is None:
                path = self.tokenizer_path or info.model_name
                self.tokenizer = await asyncio.to_thread(_load_tokenizer, path)
                log.info("tokenizer_loaded", path=path, model=self.name or info.model_name)
            if not self._named:
                self.name = info.model_name
            self.info = info  # last: `ready` flips only once everything above is in place
            log.info("scheduler_connected", target=self.client.target, model=self.name,
                     max_model_len=info.max_model_len)

    def card(self) -> dict:
        info = self.info
        assert info is not None
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "pagoda", "root": info.model_name,
                "parent": None, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                "permission": []}


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes: `pools` in the order to try; `requested` is the pool its model named."""

    requested: ModelPool
    pools: tuple[ModelPool, ...]

    def fallback_from(self, pool: ModelPool) -> str | None:
        """The requested model's name when `pool` answers in its place."""
        return None if pool is self.requested else self.requested.name


class ModelPools:
    def __init__(self, pools: Sequence[ModelPool], fallbacks: Mapping[str, str] | None = None,
                 adapters: LoRARegistry | None = None) -> None:
        if not pools:
            raise ValueError("at least one model pool is needed")
        self.pools = list(pools)
        self.fallbacks = dict(fallbacks or {})
        self.adapters = adapters or LoRARegistry()  # LoRA adapters, served by their base's pool

    @property
    def default(self) -> ModelPool:
        return self.pools[0]

    def resolve(self, model: str | None) -> ModelPool:
        """The pool a request's `model` names (empty: the default pool); 404 for any other (vLLM's
        message). A LoRA adapter's name gives its base model's pool under the adapter's name."""
        if not model:
            return self.default
        for pool in self.pools:
            if pool.answers_to(model):
                return pool
        adapter = self.adapters.get(model)
        if adapter is not None:
            return AdapterPool(adapter, self.resolve(adapter.base_model), self.adapters)
        if any(not pool.name for pool in self.pools):  # named by its scheduler, which has not answered
            raise EngineNotReadyError("the scheduler is not available yet; retry shortly")
        raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")

    def route(self, model: str | None) -> Route:
        requested = self.resolve(model)
        fallback = self._fallback_of(requested)
        if fallback is None or not fallback.in_rotation:
            return Route(requested, (requested,))
        if not requested.in_rotation:
            return Route(requested, (fallback,))  # skipped up front: no attempt on a pool that is down
        return Route(requested, (requested, fallback))

    def _fallback_of(self, pool: ModelPool) -> ModelPool | None:
        for requested, fallback in self.fallbacks.items():
            if pool.answers_to(requested):
                try:
                    return self.resolve(fallback)
                except (ModelNotFoundError, EngineNotReadyError):
                    return None  # a name no pool answers to (yet): nothing to fall back to
        return None

    def cards(self) -> list[dict]:
        """/v1/models: every pool that has connected (a pool down now still lists its model)."""
        cards = [pool.card() for pool in self.pools if pool.info is not None]
        adapters = [AdapterPool(a, self.resolve(a.base_model), self.adapters) for a in self.adapters]
        return cards + [a.card() for a in adapters if a.base.info is not None]

    @property
    def ready(self) -> bool:
        return any(pool.ready for pool in self.pools)

    async def connect(self, on_first_ready: Callable[[], Awaitable[None]] | None = None) -> None:
        """Connect every pool; `on_first_ready` runs once the first one is (the gateway serves from
        then on). Returns when all are connected; a pool that cannot load its tokenizer raises."""
        tasks = [asyncio.create_task(pool.connect()) for pool in self.pools]
        try:
            pending, called = set(tasks), False
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # re-raises a pool's failure
                if self.default.ready:
                    metrics.METRICS.model_name = self.default.name  # the label of series not per pool
                if not called and on_first_ready is not None:
                    called = True
                    await on_first_ready()
        finally:
            for task in tasks:
                task.cancel()

    async def is_serving(self) -> bool:
        """At least one connected pool says SERVING."""
        answers = await asyncio.gather(*(p.client.is_serving() for p in self.pools if p.ready))
        return any(answers)

    async def stats(self) -> dict[str, engine_pb2.EngineStats | None]:
        """Each pool's engine stats by model name; None for a pool that did not answer (so a pool
        down since startup still shows `pagoda:engine_up 0`, once it has a name)."""
        pools = [p for p in self.pools if p.name]
        results = await asyncio.gather(*(p.client.get_stats() for p in pools), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, UpstreamError):
                raise result
        return {p.name: (r if isinstance(r, engine_pb2.EngineStats) else None)
                for p, r in zip(pools, results, strict=True)}

    async def close(self) -> None:
        for pool in self.pools:
            await pool.client.close()


def pools_from_config(config: GatewayConfig) -> ModelPools:
    """One pool per model named in --scheduler (the unnamed entries first: the default pool)."""
    groups: dict[str | None, list[tuple[int, str]]] = {}
    for position, (name, target) in enumerate(config.scheduler_entries):
        name = config.served_model_name if name is None else name
        groups.setdefault(name, []).append((position, target))
    default_name = config.served_model_name
    if default_name not in groups:  # every entry named: the first named pool is the default
        default_name = next(iter(groups))
    order = [default_name, *(n for n in groups if n != default_name)]
    several = len(groups) > 1
    pools = []
    for name in order:
        entries = groups[name]
        targets = [t for _, t in entries]
        if is_dns_target(targets[0]):  # the pool's one entry (GatewayConfig checks it)
            discovery = DnsDiscovery(parse_dns_target(targets[0]), config.scheduler_dns_refresh_s,
                                     timeout_s=config.engine_timeout_s)
            client = ReplicaSet([], config.routing, config.engine_timeout_s, tls_ca=config.tls_ca,
                                discovery=discovery)
        elif len(entries) == 1 and not several:
            client = EngineClient(targets[0], config.engine_timeout_s, tls_ca=config.tls_ca)
        else:
            client = ReplicaSet(targets, config.routing, config.engine_timeout_s, tls_ca=config.tls_ca,
                                labels=[str(p) for p, _ in entries])
        tokenizer = config.tokenizer if name == default_name else None
        pools.append(ModelPool(name, client, tokenizer))
    return ModelPools(pools, dict(config.fallback_models), LoRARegistry(config.lora_modules))
