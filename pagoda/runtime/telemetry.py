"""OpenTelemetry tracing for every Pagoda process: one set-up call, W3C context helpers, span links.

Tracing is on when `--otlp-traces-endpoint` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set; otherwise
`setup_tracing` installs nothing and every tracer is OTel's no-op one, so the spans the services
create cost next to nothing and `inject_traceparent()` returns "".

Trace shape (docs/observability.md):
    gateway  `chat {model}` (SERVER, continues an HTTP `traceparent`)
      └─ scheduler `scheduler.request`   (child through gRPC metadata; events queued/scheduled/...)
    scheduler `scheduler.step`          (one per step, *linked* to every request span it served)
      └─ worker `worker.execute`        (child through `StepPlan.traceparent`)
Health probes are never traced: only the handlers above create spans.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "TRACE_HEADERS", "service_resource", "setup_tracing", "shutdown_tracing", "tracing_enabled",
    "get_tracer", "resolve_endpoint",
    "inject_traceparent", "context_from_traceparent", "metadata_with_trace_context",
    "context_from_grpc_metadata", "context_from_headers", "links_to", "StepSpanStats",
    "start_step_span", "RequestSpans", "start_genai_span", "end_genai_span",
]

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C; also the gRPC metadata keys (lowercase)

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None  # the SDK provider this module installed, once per process


def resolve_endpoint(flag: str | None) -> str | None:
    """The OTLP traces endpoint: the flag wins over the standard env var; None means tracing off."""
    return flag or os.environ.get(ENDPOINT_ENV) or None


def service_resource(default_name: str) -> Resource:
    """The process's resource: OTEL_SERVICE_NAME when set, else `default_name`."""
    return Resource.create({SERVICE_NAME: os.environ.get(SERVICE_NAME_ENV) or default_name})


def setup_tracing(service_name: str, endpoint: str | None = None, *,
                  exporter: SpanExporter | None = None) -> bool:
    """Install the global tracer provider; True when tracing is on.

    `endpoint` is `--otlp-traces-endpoint` (e.g. "http://otel-collector:4317"; OTLP over gRPC,
    plaintext for http://). `exporter` is a hook for tests (an InMemorySpanExporter): it is
    exported synchronously, so a test reads finished spans without waiting. OTEL_SERVICE_NAME
    overrides `service_name`. OTel allows one global provider per process: a second call adds
    its exporter to the provider already installed (and keeps the first service name).
    """
    global _provider
    endpoint = resolve_endpoint(endpoint)
    if endpoint is None and exporter is None:
        return False
    if _provider is None:
        _provider = TracerProvider(resource=service_resource(service_name))
        trace.set_tracer_provider(_provider)
    if endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if exporter is not None:
        _provider.add_span_processor(SimpleSpanProcessor(exporter))
    return True


def shutdown_tracing(flush_timeout_s: float = 5.0) -> None:
    """Flush the spans still queued and shut the exporters down: the last call of a service's
    graceful stop (once per process; spans ended afterwards are dropped). The flush is bounded so
    an unreachable collector cannot hold the exit."""
    if _provider is not None:
        _provider.force_flush(int(flush_timeout_s * 1000))
        _provider.shutdown()


def tracing_enabled() -> bool:
    """Whether `setup_tracing` installed a provider. Per-step code checks this once (in a
    constructor) and builds no span at all when it is False: even OTel's no-op spans cost."""
    return _provider is not None


def get_tracer(name: str) -> Tracer:
    """A tracer from the provider `setup_tracing` installed; OTel's global (no-op) one before."""
    return _provider.get_tracer(name) if _provider is not None else trace.get_tracer(name)


# --- W3C trace context: plan strings, gRPC metadata, HTTP headers ------------------------------

def inject_traceparent(span: Span | None = None) -> str:
    """The W3C traceparent of `span` (default: the current span); "" when it is not recording."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context | None:
    """The parent context carried by a traceparent string; None for "" (start_span then uses the
    current context). A malformed string yields a context without a parent: a new trace."""
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def metadata_with_trace_context(metadata: Iterable[tuple[str, str]] = (),
                                span: Span | None = None) -> list[tuple[str, str]]:
    """`metadata` plus traceparent/tracestate of `span` (default: current) for an outgoing call."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=ctx)
    kept = [(k, v) for k, v in metadata if k not in TRACE_HEADERS]
    return kept + [(k, carrier[k]) for k in TRACE_HEADERS if k in carrier]


def context_from_grpc_metadata(metadata: Iterable[tuple[str, object]] | None
                               ) -> otel_context.Context | None:
    """The caller's context from `servicer_context.invocation_metadata()`; None when absent."""
    carrier = {k.lower(): v for k, v in (metadata or ())
               if k.lower() in TRACE_HEADERS and isinstance(v, str)}
    return context_from_headers(carrier)


def context_from_headers(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The caller's context from HTTP headers (a dict with lowercase keys, or Starlette's
    case-insensitive `request.headers`); None when there is no traceparent."""
    carrier = {k: headers.get(k) for k in TRACE_HEADERS if headers.get(k)}
    if "traceparent" not in carrier:
        return None
    return _PROPAGATOR.extract(carrier)


# --- span links: one step serves many requests ---------------------------------------------------

def links_to(span_contexts: Iterable[SpanContext]) -> list[Link]:
    """One link per valid span context (non-recording requests have none): a step span cannot
    have every request it served as parent, so it links to them."""
    return [Link(sc) for sc in span_contexts if sc.is_valid]


@dataclass(slots=True, frozen=True)
class StepSpanStats:
    """What one scheduling step did; becomes the `scheduler.step` span's attributes."""

    step_id: int
    num_running: int
    num_waiting: int
    prefill_tokens: int  # tokens scheduled for requests still computing their prompt
    decode_tokens: int
    num_preemptions: int  # in this step
    kv_cache_usage: float  # 0..1
    prefix_cache_hit_tokens: int  # in this step
    swapped_out_blocks: int = 0  # KV blocks this step copies to host memory (swap preemption)
    swapped_in_blocks: int = 0  # and back

    def attributes(self) -> dict[str, int | float]:
        return {f"pagoda.step.{name}": getattr(self, name) for name in self.__slots__}


def start_step_span(tracer: Tracer, stats: StepSpanStats,
                    served: Iterable[SpanContext]) -> Span:
    """Start `scheduler.step` (a root span, linked to the requests it served). The caller sets
    `StepPlan.traceparent = inject_traceparent(span)` and ends the span when the result applied."""
    return tracer.start_span("scheduler.step", context=otel_context.Context(),
                             kind=SpanKind.INTERNAL, links=links_to(served),
                             attributes=stats.attributes())


class RequestSpans:
    """The scheduler's open `scheduler.request` spans, by request id.

    Every method is a no-op for an unknown id, so the engine loop can report events for every
    request without asking whether tracing is on or whether the request was traced.
    """

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._spans: dict[str, Span] = {}

    def start(self, request_id: str, parent: otel_context.Context | None,
              attributes: Mapping[str, object] | None = None) -> None:
        span = self._tracer.start_span("scheduler.request", context=parent or otel_context.Context(),
                                       kind=SpanKind.SERVER, attributes=dict(attributes or {}))
        span.set_attribute("gen_ai.request.id", request_id)
        span.add_event("queued")
        self._spans[request_id] = span

    def event(self, request_id: str, name: str, attributes: Mapping[str, object] | None = None) -> None:
        """`scheduled`, `preempted`, `first_token` ... (snake_case, one per thing that happened)."""
        span = self._spans.get(request_id)
        if span is not None:
            span.add_event(name, dict(attributes or {}))

    def span_contexts(self, request_ids: Iterable[str]) -> list[SpanContext]:
        """For `start_step_span(..., served=...)`."""
        return [self._spans[r].get_span_context() for r in request_ids if r in self._spans]

    def finish(self, request_id: str, finish_reason: str,
               attributes: Mapping[str, object] | None = None) -> None:
        """Record `finished` and end the span; every traced request ends here exactly once."""
        span = self._spans.pop(request_id, None)
        if span is None:
            return
        span.add_event("finished", {"finish_reason": finish_reason})
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        span.set_attributes(dict(attributes or {}))
        span.end()

    def __len__(self) -> int:
        return len(self._spans)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._spans


# --- the gateway's request span (OTel GenAI semantic conventions) --------------------------------

def start_genai_span(tracer: Tracer, operation: str, model: str,
                     parent: otel_context.Context | None, **request: object) -> Span:
    """Start `{operation} {model}` (operation "chat" or "text_completion"), continuing the caller's
    trace when `parent` came from its headers. `request` holds the gen_ai.request.* fields
    (max_tokens, temperature, top_p, top_k, seed, frequency_penalty, presence_penalty,
    stop_sequences, choice_count); None values are left out."""
    attributes: dict[str, object] = {"gen_ai.operation.name": operation,
                                      "gen_ai.provider.name": "pagoda",
                                      "gen_ai.request.model": model}
    for key, value in request.items():
        if value is not None:
            attributes[f"gen_ai.request.{key.replace('choice_count', 'choice.count')}"] = value
    return tracer.start_span(f"{operation} {model}", context=parent or otel_context.Context(),
                             kind=SpanKind.SERVER, attributes=attributes)


def end_genai_span(span: Span, *, input_tokens: int, output_tokens: int, finish_reasons: list[str],
                   time_to_first_token_s: float | None = None, time_in_queue_s: float | None = None,
                   response_id: str | None = None, error_type: str | None = None) -> None:
    """Record usage and latencies (seconds) and end the span; `error_type` marks a failure."""
    span.set_attributes({"gen_ai.usage.input_tokens": input_tokens,
                         "gen_ai.usage.output_tokens": output_tokens,
                         "gen_ai.response.finish_reasons": finish_reasons})
    optional = {"gen_ai.latency.time_to_first_token": time_to_first_token_s,
                "gen_ai.latency.time_in_queue": time_in_queue_s,
                "gen_ai.response.id": response_id, "error.type": error_type}
    span.set_attributes({k: v for k, v in optional.items() if v is not None})
    if error_type is not None:
        span.set_status(Status(StatusCode.ERROR, error_type))
    span.end()
