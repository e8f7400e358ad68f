"""The gateway's Prometheus metrics: one `pagoda.runtime.metrics.GatewayMetrics` per process.

`/metrics` shows the gateway's own latency histograms (observed per request in generation.py) and
the engine's `vllm:` gauges and counters, read from the scheduler's GetStats at scrape time.
`state.connect()` sets `METRICS.model_name` to the served model name once GetInfo answered.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from pagoda.runtime.metrics import CONTENT_TYPE_LATEST, GatewayMetrics, RequestTimer

__all__ = ["CONTENT_TYPE_LATEST", "HTTP_REQUESTS", "METRICS", "TENANT_IN_FLIGHT", "TENANT_RATE_LIMITED",
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
