"""Samples the server's Prometheus `/metrics` while a benchmark runs (vLLM metric names).

A background task scrapes every `interval_s` until `stop()`; a scrape that fails (server busy,
no /metrics) is skipped, so a server without these metrics yields an empty summary, not an error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions"  # a counter: the family name has no `_total`
WANTED = (KV_USAGE, WAITING, RUNNING, PREEMPTIONS)


def parse_metrics(text: str, wanted: tuple[str, ...] = WANTED) -> dict[str, float]:
    """{name: value summed over label sets (e.g. several engines)} for the wanted names.

    Matched on sample names, so a counter is found by its `_total` sample whichever family the
    exposition puts it in; `_created` samples are ignored.
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in wanted:
                values[name] = values.get(name, 0.0) + sample.value
    return values


@dataclass(frozen=True, slots=True)
class MetricsSample:
    t_s: float  # seconds since the sampler started
    kv_usage: float | None
    waiting: float | None
    running: float | None
    preemptions: float | None


@dataclass(frozen=True, slots=True)
class ServerSummary:
    num_samples: int
    kv_usage_max: float | None
    kv_usage_mean: float | None
    queue_depth_max: float | None
    queue_depth_mean: float | None
    running_max: float | None
    preemptions: float | None  # counter delta between the first and the last sample

    def table_rows(self) -> list[tuple[str, str]]:
        def show(value: float | None, fmt: str) -> str:
            return "n/a" if value is None else format(value, fmt)

        return [("Metrics samples:", str(self.num_samples)),
                ("KV cache usage max / mean (%):",
                 f"{show(_pct(self.kv_usage_max), '.1f')} / {show(_pct(self.kv_usage_mean), '.1f')}"),
                ("Queue depth max / mean:",
                 f"{show(self.queue_depth_max, '.0f')} / {show(self.queue_depth_mean, '.1f')}"),
                ("Running max:", show(self.running_max, ".0f")),
                ("Preemptions:", show(self.preemptions, ".0f"))]


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100


def summarize(samples: list[MetricsSample]) -> ServerSummary:
    def series(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    kv, waiting, running, preempt = (series(n) for n in ("kv_usage", "waiting", "running", "preemptions"))
    return ServerSummary(
        num_samples=len(samples),
        kv_usage_max=max(kv, default=None), kv_usage_mean=sum(kv) / len(kv) if kv else None,
        queue_depth_max=max(waiting, default=None),
        queue_depth_mean=sum(waiting) / len(waiting) if waiting else None,
        running_max=max(running, default=None),
        preemptions=preempt[-1] - preempt[0] if preempt else None)


@dataclass
class MetricsSampler:
    client: httpx.AsyncClient
    metrics_url: str
    interval_s: float = 0.5
    samples: list[MetricsSample] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None
    _started_at: float = 0.0

    def start(self) -> None:
        self._started_at = time.perf_counter()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> ServerSummary:
        """Takes one last sample (so counter deltas cover the whole run), then ends the task."""
        self._stop.set()
        if self._task is not None:
            await self._task
        return summarize(self.samples)

    async def _run(self) -> None:
        while True:
            await self.sample_once()
            if self._stop.is_set():
                return
            try:  # sleep until the next tick, waking at once on stop()
                await asyncio.wait_for(self._stop.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass

    async def sample_once(self) -> None:
        try:
            reply = await self.client.get(self.metrics_url, timeout=max(1.0, self.interval_s * 2))
            reply.raise_for_status()
            values = parse_metrics(reply.text)
        except (httpx.HTTPError, ValueError):
            return  # a missed sample, not a failed benchmark
        self.samples.append(MetricsSample(time.perf_counter() - self._started_at, values.get(KV_USAGE),
                                          values.get(WAITING), values.get(RUNNING), values.get(PREEMPTIONS)))
