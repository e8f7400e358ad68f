"""Brownout through the services: scheduler server -> Steps stream -> fake worker, in-process.

A burst of 40 concurrent requests into the fixtures' 64-block pool (they would need ~9x that)
must, with --enable-brownout, enter brownout (the `brownout_entered` log event, a span event on the
step span, EngineStats.brownout_active and the `pagoda:brownout_active` gauge), leave it, preempt
less than the same burst without it, and lose nothing: every request ends once, LENGTH, with the
fake sampler's exact tokens (a prefix of them when brownout capped its max_tokens).
"""

from __future__ import annotations

import asyncio
import random

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

from gateway.metrics import EngineStatsCollector
from pagoda.v1 import common_pb2
from scheduler_svc import convert, engine_loop
from scheduler_svc.core.brownout import BrownoutConfig
from scheduler_svc.engine_tracing import EngineTracing
from tests.service.conftest import NUM_BLOCKS
from tests.service.test_engine_service import collect, expected, generate_request, wait_for_stats

CAP = 6
BROWNOUT = BrownoutConfig(max_tokens=CAP, kv_watermark=0.9, kv_recover_watermark=0.5,
                          preemption_threshold=4, window_steps=8)


def burst() -> dict[str, tuple[list[int], int]]:
    rng = random.Random(7)
    return {f"b{i}": ([1 + rng.randrange(30) for _ in range(rng.randrange(4, 12))], rng.randrange(24, 48))
            for i in range(40)}


class Events:
    """Stands in for the engine loop's structlog logger: keeps the brownout events, and at each the
    EngineStats GetStats would answer right then (a poll could miss a short brownout)."""

    def __init__(self, log) -> None:
        self._log, self.seen, self.stats_at, self.engine = log, [], [], None

    def __getattr__(self, level):
        def emit(event, **fields):
            if event.startswith("brownout_"):
                self.seen.append((event, fields))
                self.stats_at.append(convert.stats_to_pb(
                    self.engine.scheduler.stats(), num_total_blocks=NUM_BLOCKS, num_steps=0, idle=False,
                    invariant_ok=True, request_success={}, worker_connected=True, step_seconds_sum=0.0))
            return getattr(self._log, level)(event, **fields)
        return emit


async def run_burst(engine_factory, brownout, events: Events):
    running, stub = await engine_factory(brownout=brownout, max_num_seqs=16, max_num_batched_tokens=64)
    events.engine = running.engine
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running.engine._tracing = EngineTracing(provider.get_tracer("test"))
    requests = burst()
    calls = [collect(stub, generate_request(rid, prompt, max_tokens)) for rid, (prompt, max_tokens) in requests.items()]
    results = await asyncio.gather(*calls)
    stats = await wait_for_stats(stub, lambda s: s.idle and not s.brownout_active)
    for (rid, (prompt, max_tokens)), (tokens, responses) in zip(requests.items(), results, strict=True):
        full = expected(prompt, max_tokens)
        assert tokens[0] == full[:len(tokens[0])] and len(tokens[0]) in (len(full), CAP), rid
        assert [r.finished for r in responses].count(True) == 1 and responses[-1].finished
        assert responses[-1].sequences[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert stats.invariant_ok and stats.num_used_blocks == 0 and stats.request_success["length"] == 40
    span_events = [(event.name, span.attributes["pagoda.step.step_id"]) for span in exporter.get_finished_spans()
                   if span.name == "scheduler.step" for event in span.events]
    return stats, span_events, results


async def test_a_burst_enters_and_leaves_brownout_preempts_less_and_loses_nothing(engine_factory, monkeypatch):
    events = Events(engine_loop.log)
    monkeypatch.setattr(engine_loop, "log", events)
    plain, plain_span_events, _ = await run_burst(engine_factory, None, events)
    assert events.seen == [] and plain_span_events == [] and plain.brownout_entries == 0
    brown, span_events, results = await run_burst(engine_factory, BROWNOUT, events)
    print(f"\nbrownout burst (services, fake worker): preemptions without {plain.num_preemptions}, "
          f"with {brown.num_preemptions}; entries {brown.brownout_entries}, capped "
          f"{brown.brownout_capped_requests}; events {[(e, f['reason']) for e, f in events.seen]}")
    assert brown.num_preemptions < plain.num_preemptions
    assert brown.brownout_entries >= 1 and brown.brownout_capped_requests > 0
    names = [event for event, _ in events.seen]
    assert names[0] == "brownout_entered" and names[-1] == "brownout_exited"
    assert names.count("brownout_entered") == names.count("brownout_exited") == brown.brownout_entries
    assert [name for name, _ in span_events] == names  # each on the step span it happened at
    assert [fields["step_id"] for _, fields in events.seen] == [step for _, step in span_events]
    assert sum(len(tokens[0]) == CAP for tokens, _ in results) >= brown.brownout_capped_requests

    def gauge(stats) -> bytes:
        registry = CollectorRegistry()
        registry.register(EngineStatsCollector(lambda: stats, "m"))
        return generate_latest(registry)

    assert [stats.brownout_active for stats in events.stats_at] == [name == "brownout_entered" for name in names]
    assert b'pagoda:brownout_active{model_name="m"} 1.0' in gauge(events.stats_at[0])
    assert b'pagoda:brownout_active{model_name="m"} 0.0' in gauge(brown)
    assert f'pagoda:brownout_entries_total{{model_name="m"}} {float(brown.brownout_entries)}'.encode() in gauge(brown)
