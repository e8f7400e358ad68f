"""The gateway's one frozen config: built only in `__main__` (or by tests), validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.multimodal import MediaConfig
from gateway.openai.reasoning_parsers import ReasoningParserManager
from gateway.openai.tool_parsers import AUTO, ToolParserManager
from gateway.tenancy.tenants import TenantTable, tenant_table
from gateway.upstream.dns_discovery import DEFAULT_REFRESH_S, is_dns_target, parse_dns_target
from gateway.upstream.routing import RoutingConfig


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    scheduler: str = "127.0.0.1:50052"
    """host:port of the scheduler's pagoda.v1.Engine service; several, comma-separated: data-parallel
    replicas, each request routed to one (gateway/upstream/routing.py). `MODEL=host:port`: a replica of the
    pool serving MODEL (gateway/upstream/model_pools.py); entries without a name form the default pool.
    `dns:///NAME:PORT` (or `dns://DNSSERVER:PORT/NAME:PORT`): the pool's replicas are NAME's A records,
    re-resolved (gateway/upstream/dns_discovery.py); such an entry is its pool's only one."""
    scheduler_dns_refresh_s: float = DEFAULT_REFRESH_S
    """How often a dns:// scheduler name is re-resolved (sooner when its TTL is shorter)."""
    fallback_models: tuple[tuple[str, str], ...] = ()
    """(A, B) pairs: a request for model A is served by B when A's pool is unavailable or shedding."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """With several schedulers: the routing policy, its thresholds and the replicas' breakers."""
    host: str = "127.0.0.1"
    """Interface both servers bind to."""
    port: int = 8000
    """OpenAI-compatible HTTP port (0: pick a free one)."""
    grpc_port: int = 50051
    """Public pagoda.v1.Generation gRPC port (0: pick a free one)."""
    tokenizer: str | None = None
    """Tokenizer directory; None: the model path the scheduler reports in GetInfo.model_name."""
    served_model_name: str | None = None
    """Model id clients send and /v1/models lists; None: the scheduler's model_name (as vLLM)."""
    api_key: str | None = None
    """When set, /v1/*, /tokenize, /detokenize, /version and gRPC Generate need `Bearer KEY`
    (the key of tenant "default", unlimited)."""
    api_keys: TenantTable | None = None
    """Tenants, their keys and limits, from `--api-keys FILE` (gateway/tenancy/tenants.py has the format)."""
    max_request_bytes: int = 16 * 1024 * 1024
    """Largest HTTP request body accepted; bigger bodies get 413."""
    media: MediaConfig = field(default_factory=MediaConfig)
    """Images of vision-language prompts: how many, how big, which URLs are fetched (docs/vision.md)."""
    engine_timeout_s: float = 5.0
    """Deadline for the scheduler's unary calls (GetInfo, GetStats, Abort, health)."""
    retry_after_s: int = 1
    """Retry-After header value sent with 429 when the scheduler's queue is full."""
    log_json: bool | None = None
    """JSON logs; None: JSON unless stdout is a terminal."""
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None
    """OTLP gRPC endpoint for traces; None: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: how long in-flight requests may take to finish before the servers stop."""
    tls_cert: str | None = None
    """PEM certificate chain of the public gRPC port (with tls_key); None: plaintext."""
    tls_key: str | None = None
    tls_ca: str | None = None
    """PEM CA bundle to verify the scheduler's certificate; None: plaintext channel."""
    tool_call_parser: str = "hermes"
    """The model's tool-call format, a registered ToolParser's name (vLLM's): hermes (`<tool_call>`
    JSON), llama3_json, mistral or pythonic (gateway/openai/tool_parsers/); `auto`: the one each
    model's chat template names (tool_parsers/auto_select.py; `pagoda serve`'s default)."""
    enable_auto_tool_choice: bool = False
    """Let the model decide whether to call tools (tool_choice "auto"); required/named work without."""
    reasoning_parser: str | None = None
    """The model's reasoning format, a registered ReasoningParser's name (vLLM's): deepseek_r1 or qwen3
    (gateway/openai/reasoning_parsers/); None: replies are not split, `<think>` stays in the content."""
    enable_request_timings: bool = False
    """Add the scheduler's per-request `timings` (queue, prefill, decode, first token, cached tokens)
    to chat / completion responses and to the public gRPC API's final chunk."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """(name, path) LoRA adapters served by the default model (`--lora-modules name=path`)."""

    def __post_init__(self) -> None:
        for name in ("port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a TCP port, got {getattr(self, name)}")
        if not self.schedulers:
            raise ValueError("at least one scheduler host:port is needed")
        self._check_fallbacks()
        self._check_dns()
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty when given")
        if self.engine_timeout_s <= 0:
            raise ValueError("engine_timeout_s must be positive")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must not be negative")
        if self.tool_call_parser not in (parsers := (*ToolParserManager.names(), AUTO)):
            raise ValueError(f"tool_call_parser must be {' or '.join(parsers)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in (names := ReasoningParserManager.names()):
            raise ValueError(f"reasoning_parser must be {' or '.join(names)}, got {self.reasoning_parser!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.tenant_table()  # raises when api_key is also in the file

    @property
    def schedulers(self) -> tuple[str, ...]:
        """Every scheduler's host:port, in --scheduler order (pool names dropped)."""
        return tuple(target for _, target in self.scheduler_entries)

    @property
    def scheduler_entries(self) -> tuple[tuple[str | None, str], ...]:
        """(pool name or None for the default pool, host:port) per --scheduler entry."""
        entries = []
        for entry in (e.strip() for e in self.scheduler.split(",")):
            if not entry:
                continue
            name, equals, target = entry.rpartition("=")
            if (equals and not name.strip()) or not target.strip():
                raise ValueError(f"a scheduler entry is [MODEL=]HOST:PORT, got {entry!r}")
            entries.append((name.strip() or None, target.strip()))
        return tuple(entries)

    def _check_dns(self) -> None:
        if self.scheduler_dns_refresh_s <= 0:
            raise ValueError(f"scheduler_dns_refresh_s must be positive, got {self.scheduler_dns_refresh_s}")
        pools: dict[str | None, list[str]] = {}
        for name, target in self.scheduler_entries:
            pools.setdefault(name, []).append(target)
        for name, targets in pools.items():
            if any(is_dns_target(t) for t in targets):
                parse_dns_target(next(t for t in targets if is_dns_target(t)))  # raises on a bad one
                if len(targets) > 1:
                    which = f"model {name!r}" if name else "the default pool"
                    raise ValueError(f"a dns:// scheduler is the only --scheduler of {which}, got {targets}")

    def _check_fallbacks(self) -> None:
        requested = [a for a, _ in self.fallback_models]
        if len(set(requested)) != len(requested):
            raise ValueError("each model takes one --fallback-model")
        for a, b in self.fallback_models:
            if not a or not b or a == b:
                raise ValueError(f"--fallback-model is A=B with two different models, got {a!r}={b!r}")

    def tenant_table(self) -> TenantTable:
        """Every tenant: the file's plus the single api_key's; empty (auth off) without either."""
        return tenant_table(self.api_key, self.api_keys)
