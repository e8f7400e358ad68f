"""Trace context crosses every hop: HTTP headers -> gateway span -> gRPC metadata -> scheduler
request span; scheduler step span -> StepPlan.traceparent (dataclass and protobuf) -> worker span;
step spans link to the requests they served."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagoda.contract.step import StepPlan
from pagoda.runtime import telemetry
from pagoda.runtime.telemetry import (
    RequestSpans,
    StepSpanStats,
    context_from_grpc_metadata,
    context_from_headers,
    context_from_traceparent,
    end_genai_span,
    inject_traceparent,
    metadata_with_trace_context,
    start_genai_span,
    start_step_span,
)

CALLER_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CALLER_SPAN_ID = 0xB7AD6B7169203331
CALLER_TRACEPARENT = f"00-{CALLER_TRACE_ID:032x}-{CALLER_SPAN_ID:016x}-01"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert telemetry.setup_tracing("pagoda-test", None, exporter=exporter) is True
    yield exporter
    exporter.shutdown()  # the provider outlives this module: stop keeping later tests' spans


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


def finished(exporter: InMemorySpanExporter, name: str):
    [span] = [s for s in exporter.get_finished_spans() if s.name == name]
    return span


def step_stats(step_id: int) -> StepSpanStats:
    return StepSpanStats(step_id=step_id, num_running=2, num_waiting=1, prefill_tokens=7,
                         decode_tokens=1, num_preemptions=0, kv_cache_usage=0.25,
                         prefix_cache_hit_tokens=16)


def test_tracing_is_off_without_flag_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert telemetry.setup_tracing("gateway", None) is False
    assert telemetry.resolve_endpoint(None) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4317")
    assert telemetry.resolve_endpoint(None) == "http://collector:4317"
    assert telemetry.resolve_endpoint("http://flag:4317") == "http://flag:4317"


def test_otel_service_name_overrides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert telemetry.service_resource("pagoda-gateway").attributes["service.name"] == "pagoda-gateway"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gw")
    assert telemetry.service_resource("pagoda-gateway").attributes["service.name"] == "edge-gw"


def test_non_recording_span_carries_no_context() -> None:
    assert inject_traceparent(trace.INVALID_SPAN) == ""
    assert context_from_traceparent("") is None
    assert context_from_headers({}) is None
    assert context_from_grpc_metadata(None) is None
    assert metadata_with_trace_context([("x-id", "1")], trace.INVALID_SPAN) == [("x-id", "1")]


def test_step_span_context_rides_the_plan_to_the_worker(spans: InMemorySpanExporter) -> None:
    from pagoda.v1 import worker_pb2

    step_span = start_step_span(telemetry.get_tracer("scheduler"), step_stats(41), served=[])
    plan = StepPlan(step_id=41, traceparent=inject_traceparent(step_span))
    wire = worker_pb2.StepPlan(step_id=plan.step_id, traceparent=plan.traceparent).SerializeToString()
    received = worker_pb2.StepPlan.FromString(wire)

    worker_tracer = telemetry.get_tracer("worker")
    with worker_tracer.start_as_current_span(
            "worker.execute", context=context_from_traceparent(received.traceparent)):
        pass
    step_span.end()

    step, execute = finished(spans, "scheduler.step"), finished(spans, "worker.execute")
    assert execute.context.trace_id == step.context.trace_id
    assert execute.parent.span_id == step.context.span_id
    assert step.parent is None  # a step serves many requests: a root span with links
    assert step.attributes["pagoda.step.step_id"] == 41
    assert step.attributes["pagoda.step.prefix_cache_hit_tokens"] == 16


def _serve_echo_metadata(seen: list) -> tuple[grpc.Server, int]:
    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(tuple(context.invocation_metadata()))
        return request

    method = grpc.unary_unary_rpc_method_handler(handler)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Echo", {"Call": method})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_gateway_span_continues_http_trace_and_parents_scheduler_span_over_grpc(
        spans: InMemorySpanExporter) -> None:
    gateway_span = start_genai_span(
        telemetry.get_tracer("gateway"), "chat", "tiny",
        context_from_headers({"traceparent": CALLER_TRACEPARENT}), max_tokens=16, temperature=0.0,
        top_p=None, choice_count=2)
    seen: list = []
    server, port = _serve_echo_metadata(seen)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Echo/Call")
            assert call(b"x", metadata=metadata_with_trace_context([("x-id", "r1")], gateway_span),
                        timeout=5) == b"x"
    finally:
        server.stop(None)

    request_spans = RequestSpans(telemetry.get_tracer("scheduler"))
    request_spans.start("r1", context_from_grpc_metadata(seen[0]))
    request_spans.finish("r1", "length")
    end_genai_span(gateway_span, input_tokens=5, output_tokens=16, finish_reasons=["length"],
                   time_to_first_token_s=0.125, time_in_queue_s=0.0, response_id="chatcmpl-r1")

    gateway, engine = finished(spans, "chat tiny"), finished(spans, "scheduler.request")
    assert gateway.context.trace_id == CALLER_TRACE_ID
    assert gateway.parent.span_id == CALLER_SPAN_ID
    assert engine.context.trace_id == CALLER_TRACE_ID
    assert engine.parent.span_id == gateway.context.span_id
    assert dict(gateway.attributes) == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "pagoda",
        "gen_ai.request.model": "tiny", "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0.0, "gen_ai.request.choice.count": 2,
        "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 16,
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.latency.time_to_first_token": 0.125, "gen_ai.latency.time_in_queue": 0.0,
        "gen_ai.response.id": "chatcmpl-r1"}


def test_step_span_links_every_request_it_served(spans: InMemorySpanExporter) -> None:
    tracer = telemetry.get_tracer("scheduler")
    requests = RequestSpans(tracer)
    requests.start("a", context_from_headers({"traceparent": CALLER_TRACEPARENT}))
    requests.start("b", None)
    step = start_step_span(tracer, step_stats(7), requests.span_contexts(["a", "b", "unknown"]))
    step.end()
    for request_id in ("a", "b"):
        requests.event(request_id, "scheduled", {"step_id": 7})
        requests.finish(request_id, "stop")
    requests.event("a", "first_token")  # after finish: a no-op, never an error

    served = {s.attributes["gen_ai.request.id"]: s for s in spans.get_finished_spans()
              if s.name == "scheduler.request"}
    step_span = finished(spans, "scheduler.step")
    assert [(link.context.trace_id, link.context.span_id) for link in step_span.links] == [
        (served[r].context.trace_id, served[r].context.span_id) for r in ("a", "b")]
    assert [e.name for e in served["a"].events] == ["queued", "scheduled", "finished"]
    assert served["b"].events[2].attributes["finish_reason"] == "stop"
    assert len(requests) == 0


def test_malformed_traceparent_starts_a_new_trace(spans: InMemorySpanExporter) -> None:
    with telemetry.get_tracer("worker").start_as_current_span(
            "worker.execute", context=context_from_traceparent("00-garbage-01")):
        pass
    span = finished(spans, "worker.execute")
    assert span.parent is None
    assert span.context.trace_id != CALLER_TRACE_ID


def test_shutdown_tracing_flushes_queued_spans_and_stops_exporting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service's graceful stop exports what the batch processor still holds, then stops."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000))
    monkeypatch.setattr(telemetry, "_provider", provider)  # this process's global one is untouched
    provider.get_tracer("gateway").start_span("queued").end()
    assert exporter.get_finished_spans() == ()  # held by the batch processor (hour-long delay)
    telemetry.shutdown_tracing()
    assert [s.name for s in exporter.get_finished_spans()] == ["queued"]
    provider.get_tracer("gateway").start_span("after-shutdown").end()
    provider.force_flush()  # the processors are shut down: nothing more reaches the exporter
    assert [s.name for s in exporter.get_finished_spans()] == ["queued"]
