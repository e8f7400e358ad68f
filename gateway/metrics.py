"""The gateway's Prometheus metrics: one `pagoda.runtime.metrics.GatewayMetrics` per process.

`/metrics` shows the gateway's own latency histograms (observed per request in generation.py) and
the engine's `vllm:` gauges and counters, read from the scheduler's GetStats at scrape time.
`state.connect()` sets `METRICS.model_name` to the served model name once GetInfo answered.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from pagoda.runtime.metrics import CONTENT_TYPE_LATEST, GatewayMetrics, RequestTimer

__all__ = ["CONTENT_TYPE_LATEST", "FALLBACK_REQUESTS", "HTTP_REQUESTS", "METRICS", "REPLICA_BREAKER_OPENED", "REPLICA_UP",
           "ROUTER_REQUESTS", "ROUTER_RESUBMITTED", "ROUTER_STREAMS_FAILED", "TENANT_IN_FLIGHT", "TENANT_RATE_LIMITED",
           "TENANT_REQUESTS", "TENANT_TOKENS", "RequestTimer"]

METRICS = GatewayMetrics()  # its own registry; one per process
HTTP_REQUESTS = METRICS.http_requests  # http_middleware.py counts every routed request here

# Per tenant. Tenants come from the --api-keys file (or are "default" / "anonymous"), so the label's
# values are bounded; tenancy.py creates each tenant's series at startup (they show 0 until used).
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

# Data-parallel replicas (gateway/replica_set.py), labelled by replica index (the position of its
# scheduler in --scheduler: bounded) and by routing decision (gateway/routing.py DECISIONS).
ROUTER_REQUESTS = Counter("pagoda:router_requests", "Generation requests sent to a replica, by replica and "
                          "routing decision (prefix, overloaded, no_prefix, least_loaded, round_robin, "
                          "failover).", ["replica", "decision"], registry=METRICS.registry)
ROUTER_RESUBMITTED = Counter("pagoda:router_resubmitted", "Requests re-submitted to another replica after "
                             "this one failed them before their first token.", ["replica"],
                             registry=METRICS.registry)
ROUTER_STREAMS_FAILED = Counter("pagoda:router_streams_failed", "Streams already under way that ended with "
                                "an error because their replica failed (not re-submitted).", ["replica"],
                                registry=METRICS.registry)
REPLICA_UP = Gauge("pagoda:replica_up", "1 while a replica's circuit breaker is closed (in rotation).",
                   ["replica"], registry=METRICS.registry)
REPLICA_BREAKER_OPENED = Counter("pagoda:replica_breaker_opened", "Times a replica's circuit breaker opened "
                                 "(taken out of rotation).", ["replica"], registry=METRICS.registry)

# Model pools (gateway/model_pools.py, gateway/fallback.py): labelled by configured model names
# (bounded: the pools' names) and the reason (unavailable, shedding).
FALLBACK_REQUESTS = Counter("pagoda:fallback_requests", "Requests answered by a fallback model "
                            "(--fallback-model), by the model asked for, the model that answered and why "
                            "(unavailable: its pool was down or refused with UNAVAILABLE; shedding: "
                            "RESOURCE_EXHAUSTED).", ["requested_model", "served_model", "reason"],
                            registry=METRICS.registry)
