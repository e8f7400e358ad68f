"""Traces across real processes: worker, scheduler and gateway export OTLP/gRPC to a collector
running in this test process; one completion request continues the caller's trace through all three.

Expected tree (docs/observability.md):
    caller span (traceparent header)
      └ gateway `text_completion {model}` ── scheduler `scheduler.request`
    scheduler `scheduler.step` (one per step that served the request, LINKED to scheduler.request)
      └ worker `worker.execute`
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.e2e.conftest import ENGINE_WORKER_FLAGS, start_scheduler, start_worker
from tests.e2e.gateway_conftest import start_gateway

pytestmark = pytest.mark.slow
MODEL = "pagoda-tiny"
MAX_TOKENS = 4
CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
SPAN_DEADLINE_S = 15.0


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict
    events: tuple[str, ...]
    links: tuple[tuple[str, str], ...]  # (trace id, span id)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


class SpanCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver: keeps every exported span in memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[CollectedSpan] = []

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = _attributes(resource_spans.resource.attributes).get("service.name", "")
                for scope_spans in resource_spans.scope_spans:
                    self._spans += [self._convert(service, s) for s in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    @staticmethod
    def _convert(service: str, span) -> CollectedSpan:
        return CollectedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(),
                             span.parent_span_id.hex(), _attributes(span.attributes),
                             tuple(e.name for e in span.events),
                             tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links))

    @property
    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    spans = SpanCollector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(spans, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield spans, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def traced_gateway(collector, tiny_model_dir, tmp_path_factory):
    """Dedicated worker + scheduler + gateway, all exporting to the collector."""
    _, endpoint = collector
    logs = tmp_path_factory.mktemp("traced")
    started = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export every 200 ms, not every 5 s
        env.delenv("OTEL_SERVICE_NAME", raising=False)
        try:
            worker = start_worker(tiny_model_dir, logs, otlp_traces_endpoint=endpoint, **ENGINE_WORKER_FLAGS)
            started.append(worker)
            scheduler = start_scheduler(worker.target, logs, otlp_traces_endpoint=endpoint,
                                        max_num_batched_tokens=512)
            started.append(scheduler)
            gateway, http_url = start_gateway(scheduler.target, logs, "--served-model-name", MODEL,
                                              "--otlp-traces-endpoint", endpoint)
            started.append(gateway)
            yield http_url
        finally:
            for process in reversed(started):
                process.stop()


def _tree_complete(spans: list[CollectedSpan]) -> bool:
    """Every span of the request's tree arrived: gateway and engine spans, MAX_TOKENS step spans
    linked to the engine span, and a worker span under each of them."""
    engine = [s for s in spans if s.name == "scheduler.request" and s.trace_id == CALLER_TRACE_ID]
    if not engine or not any(s.name == f"text_completion {MODEL}" for s in spans):
        return False
    steps = _steps_serving(spans, engine[0])
    workers = {s.parent_span_id for s in spans if s.name == "worker.execute"}
    return len(steps) >= MAX_TOKENS and all(s.span_id in workers for s in steps)


def _steps_serving(spans: list[CollectedSpan], engine: CollectedSpan) -> list[CollectedSpan]:
    return [s for s in spans if s.name == "scheduler.step"
            and (engine.trace_id, engine.span_id) in s.links]


def _wait_for_tree(collector: SpanCollector) -> list[CollectedSpan]:
    end = time.monotonic() + SPAN_DEADLINE_S
    while not _tree_complete(spans := collector.spans):
        assert time.monotonic() < end, f"spans missing after {SPAN_DEADLINE_S}s: " \
                                       f"{sorted({(s.service, s.name) for s in spans})}"
        time.sleep(0.1)  # poll; the deadline bounds the wait
    return spans


def test_one_request_is_traced_through_gateway_scheduler_and_worker(collector, traced_gateway):
    spans_seen, _ = collector
    reply = httpx.post(f"{traced_gateway}/v1/completions", timeout=30, headers={
        "traceparent": f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"}, json={
        "model": MODEL, "prompt": "The river flows", "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    spans = _wait_for_tree(spans_seen)

    # The gateway span continues the caller's trace and carries the GenAI attributes.
    [gateway] = [s for s in spans if s.name == f"text_completion {MODEL}"]
    assert (gateway.service, gateway.trace_id, gateway.parent_span_id) == \
        ("pagoda-gateway", CALLER_TRACE_ID, CALLER_SPAN_ID)
    attrs = gateway.attributes
    assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.response.id"] == reply.json()["id"]
    assert attrs["gen_ai.latency.time_to_first_token"] > 0
    assert attrs["gen_ai.latency.time_in_queue"] >= 0

    # The scheduler's request span is its child (traceparent in the gRPC metadata).
    [engine] = [s for s in spans if s.name == "scheduler.request"]
    assert (engine.service, engine.trace_id, engine.parent_span_id) == \
        ("pagoda-scheduler", CALLER_TRACE_ID, gateway.span_id)
    assert engine.events == ("queued", "scheduled", "first_token", "finished")

    # One step span per step that computed for the request (prefill + sample, then 3 decodes),
    # each linked to the request span and parent of exactly one worker span.
    steps = _steps_serving(spans, engine)
    assert len(steps) == MAX_TOKENS and all(s.service == "pagoda-scheduler" for s in steps)
    step_ids = sorted(s.attributes["pagoda.step.step_id"] for s in steps)
    assert step_ids == list(range(step_ids[0], step_ids[0] + MAX_TOKENS))  # consecutive steps
    assert sum(s.attributes["pagoda.step.prefill_tokens"] for s in steps) == usage["prompt_tokens"]
    for step in steps:
        assert step.parent_span_id == "" and step.trace_id != CALLER_TRACE_ID  # a root span
        assert 0 <= step.attributes["pagoda.step.kv_cache_usage"] <= 1
        [worker] = [s for s in spans if s.name == "worker.execute" and s.parent_span_id == step.span_id]
        assert (worker.service, worker.trace_id) == ("pagoda-worker", step.trace_id)
        assert worker.attributes["pagoda.step.step_id"] == step.attributes["pagoda.step.step_id"]
        assert worker.attributes["pagoda.worker.forward_seconds"] > 0

    # Health probes (the fixtures polled every service's grpc.health.v1 and /ready) are not traced.
    assert {s.name for s in spans} <= {f"text_completion {MODEL}", "scheduler.request",
                                       "scheduler.step", "worker.execute"}
