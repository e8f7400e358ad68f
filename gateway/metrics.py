"""The gateway's Prometheus metrics: one `pagoda.runtime.metrics.GatewayMetrics` per process.

`/metrics` shows the gateway's own latency histograms (observed per request in generation.py) and
the engine's `vllm:` gauges and counters, read from the scheduler's GetStats at scrape time.
`state.connect()` sets `METRICS.model_name` to the served model name once GetInfo answered.
"""

from __future__ import annotations

from pagoda.runtime.metrics import CONTENT_TYPE_LATEST, GatewayMetrics, RequestTimer

__all__ = ["CONTENT_TYPE_LATEST", "HTTP_REQUESTS", "METRICS", "RequestTimer"]

METRICS = GatewayMetrics()  # its own registry; one per process
HTTP_REQUESTS = METRICS.http_requests  # http_middleware.py counts every routed request here
