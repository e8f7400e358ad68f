"""Latency and throughput math of the serving benchmark (vLLM's `benchmark_serving` definitions).

- TTFT: request sent -> first chunk carrying output text.
- ITL: the gap between successive output chunks of one request (every gap, pooled over requests).
- TPOT: (E2E - TTFT) / (output tokens - 1), one value per request with more than one output token.
- E2E: request sent -> last byte of the stream.
- Throughput: completed requests (or tokens) / benchmark duration (first send -> last finish).
Seconds everywhere; only the printed table shows milliseconds (as vLLM's does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 95, 99)
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome. Times are seconds on one monotonic clock (time.perf_counter)."""

    prompt_len: int
    expected_output_len: int
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output text
    finished_at: float = 0.0
    output_len: int = 0  # from the final usage chunk when the server sends one, else the expected len
    cached_tokens: int = 0  # prompt tokens the server's prefix cache supplied (usage, when reported)
    timings: dict | None = None  # the server's `timings` (queue_ms, prompt_ms, ...), when it sends them
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent_at

    @property
    def e2e(self) -> float:
        return self.finished_at - self.sent_at

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None  # one token: no decode time to spread
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    mean_s: float
    median_s: float
    p95_s: float
    p99_s: float

    @staticmethod
    def of(values: Sequence[float]) -> LatencyStats:
        if not values:
            return LatencyStats(0.0, 0.0, 0.0, 0.0)
        p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)  # linear interp.
        return LatencyStats(float(np.mean(values)), float(p50), float(p95), float(p99))


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats

    def to_json(self) -> dict:
        """Flat keys (`mean_ttft_s`, `p99_itl_s`, ...) like vLLM's result JSON, in seconds."""
        out = {k: v for k, v in asdict(self).items() if k not in LATENCY_NAMES}
        for name in LATENCY_NAMES:
            stats: LatencyStats = getattr(self, name)
            out[f"mean_{name}_s"] = stats.mean_s
            out[f"median_{name}_s"] = stats.median_s
            out[f"p95_{name}_s"] = stats.p95_s
            out[f"p99_{name}_s"] = stats.p99_s
        return out


def compute_metrics(records: Sequence[RequestRecord], duration_s: float) -> BenchmarkMetrics:
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    itls = [gap for r in done for gap in r.itls]
    tpots = [t for r in done if (t := r.tpot) is not None]
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    return BenchmarkMetrics(
        completed=len(done), failed=len(records) - len(done), duration_s=duration_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(done) * per_second, output_throughput=output_tokens * per_second,
        total_token_throughput=(input_tokens + output_tokens) * per_second,
        ttft=LatencyStats.of([r.ttft for r in done]), tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of(itls), e2el=LatencyStats.of([r.e2e for r in done]))


def arrival_intervals(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, scale=1/(rate*burstiness)).

    The mean interval is 1/rate whatever the burstiness; burstiness 1 is a Poisson process,
    lower is burstier, higher is more regular. An infinite rate sends everything at once.
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError("request rate must be > 0 (or inf)")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests).tolist()


def format_table(title: str, metrics: BenchmarkMetrics, extra_rows: Sequence[tuple[str, str]] = ()) -> str:
    """vLLM-style result table; latencies in ms."""
    rows: list[tuple[str, str]] = [
        ("Successful requests:", f"{metrics.completed}"),
        ("Failed requests:", f"{metrics.failed}"),
        ("Benchmark duration (s):", f"{metrics.duration_s:.2f}"),
        ("Total input tokens:", f"{metrics.total_input_tokens}"),
        ("Total generated tokens:", f"{metrics.total_output_tokens}"),
        ("Request throughput (req/s):", f"{metrics.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{metrics.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{metrics.total_token_throughput:.2f}"),
    ]
    headers = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
               "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    lines = [f"{' ' + title + ' ':=^56}", *_rows(rows)]
    for name in LATENCY_NAMES:
        stats: LatencyStats = getattr(metrics, name)
        lines.append(f"{headers[name]:-^56}")
        lines += _rows([(f"{label} {name.upper()} (ms):", f"{value * 1000:.2f}") for label, value in
                        (("Mean", stats.mean_s), ("Median", stats.median_s), ("P95", stats.p95_s),
                         ("P99", stats.p99_s))])
    if extra_rows:
        lines.append(f"{'Server (from /metrics)':-^56}")
        lines += _rows(extra_rows)
    lines.append("=" * 56)
    return "\n".join(lines)


def _rows(rows: Sequence[tuple[str, str]]) -> list[str]:
    return [f"{label:<42}{value:>14}" for label, value in rows]
