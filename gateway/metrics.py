"""The gateway's Prometheus metrics (a minimal set; extend here, names follow vLLM's `vllm:` ones).

Metric objects live in the default registry and are created once per process at import.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

HTTP_REQUESTS = Counter("pagoda:http_requests_total", "HTTP requests by route and status code",
                        ["route", "status"])
REQUEST_SUCCESS = Counter("pagoda:request_success_total", "Finished sequences by finish reason",
                          ["finished_reason"])
PROMPT_TOKENS = Counter("pagoda:prompt_tokens_total", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter("pagoda:generation_tokens_total", "Tokens received from the engine")
TIME_TO_FIRST_TOKEN = Histogram("pagoda:time_to_first_token_seconds",
                                "Gateway arrival to first token", buckets=_LATENCY_BUCKETS)
E2E_LATENCY = Histogram("pagoda:e2e_request_latency_seconds", "Gateway arrival to last token",
                        buckets=_LATENCY_BUCKETS)


class RequestTimer:
    """Records one request's latencies and token counts as they happen."""

    __slots__ = ("_start", "_first_token_seen")

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._first_token_seen = False

    def tokens_arrived(self, num_tokens: int) -> None:
        if num_tokens and not self._first_token_seen:
            self._first_token_seen = True
            TIME_TO_FIRST_TOKEN.observe(time.perf_counter() - self._start)
        GENERATION_TOKENS.inc(num_tokens)

    def finished(self, num_prompt_tokens: int, finish_reasons: Iterable[str | None]) -> None:
        E2E_LATENCY.observe(time.perf_counter() - self._start)
        PROMPT_TOKENS.inc(num_prompt_tokens)
        for reason in finish_reasons:
            if reason is not None:
                REQUEST_SUCCESS.labels(finished_reason=reason).inc()


def exposition() -> tuple[bytes, str]:
    """(body, content type) for GET /metrics."""
    return generate_latest(), CONTENT_TYPE_LATEST
