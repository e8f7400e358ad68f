"""The gateway's Prometheus metrics, served at its `/metrics`: one scrape target shows the whole engine.

- Per-request latency histograms are observed by the gateway, which sees every token arrive
  (`GatewayMetrics.request_timer()`, per request in generation.py).
- Engine state and counters are read from the scheduler's `GetStats` at scrape time and turned into
  gauges/counters by `EngineStatsCollector`; nothing is cached between scrapes.
- The gateway's own counters: HTTP requests, tenants, replicas and routing, model fallbacks.
vLLM's names and buckets (so its Grafana dashboards work), a `model_name` label on every engine and
latency series, always seconds. prometheus_client appends `_total` to counters when it exposes them.
`METRICS` is the process's one `GatewayMetrics`; the model pools set `METRICS.model_name` to the
served model name once GetInfo answered.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "FALLBACK_REQUESTS", "HTTP_REQUESTS", "INTER_TOKEN_BUCKETS", "METRICS",
           "REPLICA_BREAKER_OPENED", "REPLICA_UP", "REQUEST_LATENCY_BUCKETS", "ROUTER_REQUESTS",
           "ROUTER_RESUBMITTED", "ROUTER_STREAMS_FAILED", "ROUTER_STREAM_FAILOVERS", "ROUTER_MIGRATIONS", "TENANT_IN_FLIGHT", "TENANT_RATE_LIMITED",
           "TENANT_REQUESTS", "TENANT_TOKENS", "TTFT_BUCKETS", "EngineStatsCollector", "GatewayMetrics",
           "RequestTimer"]

# vLLM v1 (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

StatsGetter = Callable[[], Any]  # -> an EngineStats message (or any object with its fields) | None
ModelName = str | Callable[[], str]  # a callable when the name is known only later (after GetInfo)

# (name as exposed without _total, EngineStats field, help)
_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Requests in the running batch."),
    ("vllm:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage, 0..1 (1 = full)."),
    ("pagoda:num_free_blocks", "num_free_blocks", "KV blocks on the free list."),
    ("pagoda:num_evictable_blocks", "num_evictable_blocks", "Cached blocks no request uses."),
    ("pagoda:num_total_blocks", "num_total_blocks", "KV blocks in the pool."),
    ("pagoda:worker_connected", "worker_connected", "1 when the scheduler has a worker stream."),
    ("pagoda:num_pinned_blocks", "num_pinned_blocks", "KV blocks held for --pinned-prompts."),
    ("vllm:num_requests_swapped", "num_swapped",
     "Waiting requests whose KV is swapped out to host memory (counted in num_requests_waiting too)."),
    ("vllm:cpu_cache_usage_perc", "cpu_kv_cache_usage", "Host (swap space) KV-cache usage, 0..1."),
    ("pagoda:num_cpu_blocks", "num_cpu_blocks", "KV blocks in the host swap space."),
    ("pagoda:num_offload_blocks", "num_offload_blocks", "KV blocks in the prefix cache's host tier."),
    ("pagoda:offload_cache_usage_perc", "offload_kv_cache_usage", "Prefix cache host tier usage, 0..1."),
    ("pagoda:num_disk_blocks", "num_disk_blocks", "Block files the prefix cache's disk tier may hold."),
    ("pagoda:disk_cache_usage_perc", "disk_kv_cache_usage", "Prefix cache disk tier usage, 0..1."),
    ("pagoda:brownout_active", "brownout_active",
     "1 while the scheduler is in brownout (memory pressure: smaller steps, new requests' max_tokens capped)."),
)
_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
    ("vllm:num_preemptions", "num_preemptions", "Preemptions."),
    ("vllm:prompt_tokens", "prompt_tokens", "Prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Generation tokens processed."),
    ("pagoda:blocks_allocated", "blocks_allocated", "KV blocks taken from the pool."),
    ("pagoda:blocks_freed", "blocks_freed", "KV blocks returned to the pool."),
    ("pagoda:step_failures", "num_step_failures", "Steps the worker failed (forward or sampler raised)."),
    ("pagoda:requests_isolated", "num_requests_isolated",
     "Requests failed alone because every step computing them failed (poison isolation)."),
    ("vllm:spec_decode_num_drafts", "spec_num_drafts", "Speculative decoding: sequence-steps with drafts."),
    ("vllm:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens proposed."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted."),
    ("pagoda:brownout_entries", "brownout_entries", "Times the scheduler entered brownout."),
    ("pagoda:swap_preemptions", "num_swap_preemptions", "Preemptions that swapped the KV out (not recomputed)."),
    ("pagoda:swapped_out_blocks", "blocks_swapped_out", "KV blocks copied from the device to host memory."),
    ("pagoda:swapped_in_blocks", "blocks_swapped_in", "KV blocks copied from host memory back to the device."),
    ("pagoda:prefill_tokens_computed", "prefill_tokens_computed",
     "Prefill tokens computed, recomputation after preemption included."),
    ("pagoda:offloaded_blocks", "blocks_offloaded",
     "Cached KV blocks copied to the host tier when evicted from the device pool."),
    ("pagoda:offload_loaded_blocks", "blocks_loaded",
     "KV blocks copied back from the host tier for a prefix hit (not recomputed)."),
    ("pagoda:offload_dropped_blocks", "blocks_offload_dropped", "Host tier entries dropped when it was full."),
    ("pagoda:disk_written_blocks", "blocks_disk_written", "KV blocks the host tier dropped, written to the disk tier."),
    ("pagoda:disk_loaded_blocks", "blocks_disk_loaded", "KV blocks loaded from the disk tier for a prefix hit."),
    ("pagoda:disk_dropped_blocks", "blocks_disk_dropped", "Disk tier files deleted when it was full, or blocks it had no room for."),
    ("pagoda:brownout_capped_requests", "brownout_capped_requests",
     "Requests whose max_tokens brownout lowered at admission."),
    ("pagoda:kv_pulls", "kv_pulls", "Migrated continuations whose KV this replica's worker pulled from the source "
     "worker over gRPC (--kv-transfer grpc)."),
    ("pagoda:kv_pull_fallbacks", "kv_pull_fallbacks", "Migrated continuations whose KV pull failed (source gone, "
     "export unknown or expired, refused block, deadline): they recomputed their context."),
    ("pagoda:kv_pull_bytes", "kv_pull_bytes", "Bytes of migrated KV pulled worker to worker over gRPC."),
    ("pagoda:encoder_tokens", "encoder_tokens",
     "Image embedding rows the worker's vision encoder produced (docs/vision.md)."),
    ("pagoda:encoder_cache_hits", "encoder_cache_hits",
     "Image lookups the worker's encoder cache served without running the encoder."),
)


class EngineStatsCollector:
    """Turns the scheduler's EngineStats into metric families at each scrape.

    `get_stats` returns the stats, or None when the scheduler did not answer: then only
    `pagoda:engine_up 0` is exposed (no stale values pretending to be current). With model pools it
    returns {model name: stats or None}: one sample per model in each family.
    """

    def __init__(self, get_stats: StatsGetter, model_name: ModelName) -> None:
        self._get_stats = get_stats
        self._model_name = model_name if callable(model_name) else (lambda: model_name)

    def collect(self) -> Iterator[Metric]:
        snapshot = self._get_stats()
        per_model = snapshot if isinstance(snapshot, dict) else {self._model_name(): snapshot}
        up = GaugeMetricFamily("pagoda:engine_up", "1 when the scheduler answered GetStats.",
                               labels=["model_name"])
        for model, stats in per_model.items():
            up.add_metric([model], 0.0 if stats is None else 1.0)
        yield up
        answered = [(model, stats) for model, stats in per_model.items() if stats is not None]
        if not answered:
            return
        for name, field, doc in _GAUGES:
            yield _family(GaugeMetricFamily, name, doc, answered, field)
        for name, field, doc in _COUNTERS:
            yield _family(CounterMetricFamily, name, doc, answered, field)
        success = CounterMetricFamily("vllm:request_success", "Finished requests, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position (0-based).",
                                      labels=["model_name", "position"])
        step = SummaryMetricFamily("pagoda:step_duration_seconds", "Scheduler step wall time.",
                                   labels=["model_name"])
        for model, stats in answered:
            for reason, count in sorted(stats.request_success.items()):
                success.add_metric([model, reason], count)
            for position, count in enumerate(stats.spec_accepted_per_pos):
                per_pos.add_metric([model, str(position)], count)
            step.add_metric([model], count_value=stats.num_steps, sum_value=stats.step_seconds_sum)
        yield from (success, per_pos, step)
        yield from _lora_info(answered)
        yield from _tenant_families(answered)


def _lora_info(answered: list[tuple[str, Any]]) -> Iterator[Metric]:
    """vLLM's `vllm:lora_requests_info`: the adapters in use as labels (comma-separated names),
    the value the scrape time, as vLLM does; only for engines that serve LoRA."""
    lora = [(model, stats) for model, stats in answered if getattr(stats, "max_loras", 0)]
    if not lora:
        return
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                               labels=["model_name", "running_lora_adapters", "waiting_lora_adapters",
                                       "max_lora"])
    for model, stats in lora:
        family.add_metric([model, ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                           str(stats.max_loras)], time.time())
    yield family


# The scheduler's per-tenant figures (EngineStats.tenant_*, scheduler_svc/core/tenants.py):
# (name as exposed without _total, EngineStats map field, help); labelled model_name and tenant.
_TENANT_GAUGES = (
    ("pagoda:tenant_kv_blocks", "tenant_blocks_held", "Device KV blocks a tenant holds (in use + cached)."),
    ("pagoda:tenant_kv_blocks_cap", "tenant_blocks_cap", "Device KV blocks a tenant may hold (its cap)."),
    ("pagoda:tenant_requests_waiting", "tenant_requests_waiting", "A tenant's sequences waiting for admission."),
    ("pagoda:tenant_virtual_tokens", "tenant_virtual_tokens", "A tenant's fair-share virtual token counter."),
)
_TENANT_COUNTERS = (
    ("pagoda:tenant_prompt_tokens", "tenant_prompt_tokens", "Prompt tokens the scheduler served a tenant."),
    ("pagoda:tenant_generation_tokens", "tenant_generation_tokens", "Tokens the scheduler generated for a tenant."),
)


def _tenant_families(answered: list[tuple[str, Any]]) -> Iterator[Metric]:
    """One sample per (model, tenant); the anonymous tenant ("" upstream) as "anonymous", the name
    the gateway's own tenant metrics use."""
    for families, cls in ((_TENANT_GAUGES, GaugeMetricFamily), (_TENANT_COUNTERS, CounterMetricFamily)):
        for name, field, doc in families:
            family = cls(name, doc, labels=["model_name", "tenant"])
            for model, stats in answered:
                for tenant, value in sorted(getattr(stats, field, {}).items()):
                    family.add_metric([model, tenant or "anonymous"], value)
            yield family


def _family(cls: type, name: str, doc: str, answered: list[tuple[str, Any]], field: str) -> Metric:
    family = cls(name, doc, labels=["model_name"])
    for model, stats in answered:
        family.add_metric([model], getattr(stats, field))
    return family


class RequestTimer:
    """One request's timing, seen from the gateway; feeds the latency histograms.

    `on_tokens` is called per response delta (a delta may carry several tokens: the gap is
    spread evenly over them, as one inter-token latency per token). Times are monotonic seconds.
    """

    __slots__ = ("_ttft", "_itl", "_e2e", "_queue", "arrival", "first_token", "last_token")

    def __init__(self, metrics: GatewayMetrics, now: float | None = None, model_name: str | None = None) -> None:
        name = metrics.model_name if model_name is None else model_name
        self._ttft = metrics.time_to_first_token.labels(name)
        self._itl = metrics.inter_token_latency.labels(name)
        self._e2e = metrics.e2e_request_latency.labels(name)
        self._queue = metrics.request_queue_time.labels(name)
        self.arrival = time.monotonic() if now is None else now
        self.first_token: float | None = None
        self.last_token: float | None = None

    def on_tokens(self, num_tokens: int, now: float | None = None) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_token is None:
            self.first_token = now
            self._ttft.observe(now - self.arrival)
            num_tokens -= 1  # the first token has a TTFT, not an inter-token latency
        elif num_tokens:
            gap = (now - self.last_token) / num_tokens
            for _ in range(num_tokens):
                self._itl.observe(gap)
        self.last_token = now

    @property
    def time_to_first_token_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def finish(self, queue_seconds: float | None, now: float | None = None) -> float:
        """Observe end-to-end latency (and the scheduler's queue time); returns e2e seconds."""
        now = time.monotonic() if now is None else now
        e2e = now - self.arrival
        self._e2e.observe(e2e)
        if queue_seconds is not None:
            self._queue.observe(queue_seconds)
        return e2e


class GatewayMetrics:
    """Every metric of one gateway, in its own registry (so tests can build several).

    `model_name` may be set after construction (the gateway learns it from GetInfo); timers made
    before that carry the old label value.
    """

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Time between two output tokens.", INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Time in the scheduler's queue.",
            REQUEST_LATENCY_BUCKETS)
        self.http_requests = Counter("pagoda:http_requests", "HTTP requests by route and status code.",
                                     ["route", "status"], registry=self.registry)
        self._latest_stats: Any = None
        self.registry.register(EngineStatsCollector(lambda: self._latest_stats,
                                                    lambda: self.model_name))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def request_timer(self, now: float | None = None, model_name: str | None = None) -> RequestTimer:
        """A timer labelled `model_name` (default: `self.model_name`; model pools pass theirs)."""
        return RequestTimer(self, now, model_name)

    async def scrape(self, fetch_stats: Callable[[], Awaitable[Any]]) -> bytes:
        """The exposition text, with engine stats fetched now: `fetch_stats` returns the scheduler's
        EngineStats, or None when it does not answer (then `pagoda:engine_up 0`); or, with model
        pools, {model name: EngineStats or None}.
        No await between storing the stats and rendering, so concurrent scrapes stay consistent."""
        self._latest_stats = await fetch_stats()
        return generate_latest(self.registry)


METRICS = GatewayMetrics()  # its own registry; one per process
HTTP_REQUESTS = METRICS.http_requests  # openai/middleware.py counts every routed request here

# Per tenant. Tenants come from the --api-keys file (or are "default" / "anonymous"), so the label's
# values are bounded; tenancy/leases.py creates each tenant's series at startup (they show 0 until used).
TENANT_REQUESTS = Counter("pagoda:tenant_requests", "Generation requests admitted, by tenant.",
                          ["tenant"], registry=METRICS.registry)
TENANT_RATE_LIMITED = Counter(
    "pagoda:tenant_rate_limited", "Generation requests refused with 429 / RESOURCE_EXHAUSTED, by tenant and "
    "the limit that refused them (requests, tokens, concurrency).", ["tenant", "limit"],
    registry=METRICS.registry)
TENANT_TOKENS = Counter("pagoda:tenant_tokens", "Tokens charged to a tenant's tokens/min budget "
                        "(prompt + generated, settled when the request ends).", ["tenant"],
                        registry=METRICS.registry)
TENANT_IN_FLIGHT = Gauge("pagoda:tenant_requests_in_flight", "Admitted generation requests not yet ended.",
                         ["tenant"], registry=METRICS.registry)

# Data-parallel replicas (gateway/upstream/replica_set.py), labelled by replica index (the position of its
# scheduler in --scheduler: bounded) and by routing decision (gateway/upstream/routing.py DECISIONS).
ROUTER_REQUESTS = Counter("pagoda:router_requests", "Generation requests sent to a replica, by replica and "
                          "routing decision (prefix, overloaded, no_prefix, least_loaded, round_robin, session, "
                          "failover).", ["replica", "decision"], registry=METRICS.registry)
ROUTER_RESUBMITTED = Counter("pagoda:router_resubmitted", "Requests re-submitted to another replica after "
                             "this one failed them before their first token.", ["replica"],
                             registry=METRICS.registry)
ROUTER_STREAMS_FAILED = Counter("pagoda:router_streams_failed", "Streams already under way that ended with "
                                "an error because their replica failed (not re-submitted).", ["replica"],
                                registry=METRICS.registry)
ROUTER_STREAM_FAILOVERS = Counter("pagoda:router_stream_failovers", "Streams already under way whose replica "
                                  "failed and that went on on another replica (mid-stream failover); "
                                  "labelled by the replica that failed.", ["replica"], registry=METRICS.registry)
ROUTER_MIGRATIONS = Counter("pagoda:router_migrations", "Streams moved to another replica with their KV "
                            "(live migration: POST /admin/migrate, drain); labelled by the replica they left.",
                            ["replica"], registry=METRICS.registry)
REPLICA_UP = Gauge("pagoda:replica_up", "1 while a replica's circuit breaker is closed (in rotation).",
                   ["replica"], registry=METRICS.registry)
REPLICA_BREAKER_OPENED = Counter("pagoda:replica_breaker_opened", "Times a replica's circuit breaker opened "
                                 "(taken out of rotation).", ["replica"], registry=METRICS.registry)

# Model pools (gateway/upstream/model_pools.py, upstream/fallback.py): labelled by configured model names
# (bounded: the pools' names) and the reason (unavailable, shedding).
FALLBACK_REQUESTS = Counter("pagoda:fallback_requests", "Requests answered by a fallback model "
                            "(--fallback-model), by the model asked for, the model that answered and why "
                            "(unavailable: its pool was down or refused with UNAVAILABLE; shedding: "
                            "RESOURCE_EXHAUSTED).", ["requested_model", "served_model", "reason"],
                            registry=METRICS.registry)
