"""The core both public APIs share: a tokenized request in, per-sequence text deltas out.

Streams token ids from the scheduler, detokenizes each sequence incrementally, applies stop
strings (trimming them and cancelling the upstream call once every sequence is done) and counts
usage. Leaving the iteration early (client gone) cancels the upstream Generate call too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import Span

from gateway import metrics
from gateway.errors import UpstreamError
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
from gateway.upstream.engine_client import EngineClient
from pagoda.contract.common_codec import finish_reason_from_pb, mm_to_pb, sampling_to_pb
from pagoda.contract.multimodal import MultiModalInput
from pagoda.contract.params import SamplingParams
from pagoda.contract.structured import check_grammar
from pagoda.runtime.telemetry import (
    end_genai_span,
    get_tracer,
    metadata_with_trace_context,
    start_genai_span,
    tracing_enabled,
)
from pagoda.v1 import common_pb2, engine_pb2


class UsageRecorder(Protocol):
    """What generate() tells of the tokens a request has cost so far: a tenant's lease, or a view
    of one shared by several prompts. The caller owns it (and closes the lease)."""

    def record(self, used_tokens: int) -> None:
        """Prompt + generated tokens so far; 0 when the engine refused the request."""


# A session's retain TTL when its request names none: long enough for a person to type the next turn.
DEFAULT_SESSION_TTL_S = 600.0


@dataclass(frozen=True, slots=True)
class GenerationInput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()  # stop strings (the engine handles stop token ids)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str = ""
    session_id: str = ""  # a session lease (docs/kv_tiers.md); "" none
    session_ttl_s: float = 0.0
    tenant: str = ""  # set at admission (tenancy/leases.py): the API key's tenant, "" anonymous
    kv_share: float = 0.0  # its keys-file kv_share; 0: the scheduler's default
    mm_inputs: tuple[MultiModalInput, ...] = ()  # the prompt's images, expanded (docs/vision.md)


@dataclass(slots=True)
class SequenceChunk:
    """New output of one of the n sequences since the previous step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # parallel to token_ids
    finish_reason: str | None = None  # "stop" / "length" / "abort" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # With sampling.prompt_logprobs: the prompt's tokens 1.. (the first has none), on the
    # sequence's first chunk only.
    prompt_logprobs: list[common_pb2.TokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class GenerationStep:
    chunks: list[SequenceChunk]
    usage: Usage | None = None  # set on the last step only
    progress: Usage | None = None  # the usage so far, on every step (continuous_usage_stats)
    timings: common_pb2.RequestTimings | None = None  # set on the last step only


class _Sequence:
    """Per-sequence state: detokenizer, stop matcher, counters."""

    __slots__ = ("detokenizer", "matcher", "num_tokens", "finish_reason", "prompt_logprobs")

    def __init__(self, tokenizer: Tokenizer, request: GenerationInput) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                  request.skip_special_tokens)
        self.matcher = StopStringMatcher(request.stop, request.include_stop_str_in_output)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.prompt_logprobs: list[common_pb2.TokenLogprobs] | None = None  # until its next chunk

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, delta: engine_pb2.SequenceDelta, stop_token_ids: tuple[int, ...]) -> SequenceChunk:
        chunk = SequenceChunk(index=delta.index, prompt_logprobs=self.prompt_logprobs)
        self.prompt_logprobs = None
        has_logprobs = len(delta.logprobs) == len(delta.token_ids)
        for position, token_id in enumerate(delta.token_ids):
            if self.finished:
                break  # tokens sampled after a stop string matched are dropped (and not counted)
            self.num_tokens += 1
            chunk.token_ids.append(token_id)
            if has_logprobs:
                chunk.logprobs.append(delta.logprobs[position])
            self._add_text(chunk, self.detokenizer.step(token_id))
        reason = finish_reason_name(delta.finish_reason)
        if reason is not None and not self.finished:
            self._add_text(chunk, self.detokenizer.flush())
            if not self.finished:
                chunk.text += self.matcher.flush()
                self.finish_reason = chunk.finish_reason = reason
                last = chunk.token_ids[-1] if chunk.token_ids else None
                chunk.stop_reason = last if reason == "stop" and last in stop_token_ids else None
        return chunk

    def _add_text(self, chunk: SequenceChunk, text: str) -> None:
        check = self.matcher.feed(text)
        chunk.text += check.text
        if check.stop is not None:
            self.finish_reason = chunk.finish_reason = "stop"
            chunk.stop_reason = check.stop


def finish_reason_name(code: int) -> str | None:
    """"stop" / "length" / "abort" / "error", or None while the sequence runs."""
    reason = finish_reason_from_pb(code)
    return reason.value if reason is not None else None


async def check_structured_outputs(sampling: SamplingParams) -> None:
    """400 for a schema, regex or grammar that does not compile; off the event loop (a new JSON
    schema can take tens of ms), cached so a repeated one is free. Both public APIs call it."""
    if sampling.structured_outputs is not None:
        await asyncio.to_thread(check_grammar, sampling.structured_outputs)


def to_engine_request(request: GenerationInput) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_to_pb(request.sampling), priority=request.priority,
        cache_salt=request.cache_salt, session_id=request.session_id,
        session_ttl_s=request.session_ttl_s if request.session_id else 0.0, tenant=request.tenant,
        kv_share=request.kv_share, mm_inputs=[mm_to_pb(m) for m in request.mm_inputs])


def start_request_span(operation: str, model: str, parent: Context | None,
                       request: GenerationInput, tenant: str | None = None,
                       fallback_from: str | None = None) -> Span | None:
    """The request's `{operation} {model}` span (operation "chat" or "text_completion"), a child
    of the caller's span when `parent` came from its traceparent, with the tenant as `pagoda.tenant`
    and, when `model` answers for another (--fallback-model), that one as `pagoda.fallback_from`.
    Hand it to generate(), which ends it. None when tracing is off (no span, no traceparent sent
    upstream)."""
    if not tracing_enabled():
        return None
    s = request.sampling
    span = start_genai_span(
        get_tracer("gateway"), operation, model, parent, max_tokens=s.max_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
        stop_sequences=list(request.stop) or None, choice_count=s.n)
    if tenant is not None:
        span.set_attribute("pagoda.tenant", tenant)
    if fallback_from is not None:
        span.set_attribute("pagoda.fallback_from", fallback_from)
    return span


async def generate(client: EngineClient, tokenizer: Tokenizer, request: GenerationInput,
                   span: Span | None = None, usage: UsageRecorder | None = None,
                   model: str | None = None) -> AsyncIterator[GenerationStep]:
    """Yield one GenerationStep per upstream response; the last one carries usage.

    Observes the request's latency histograms (labelled `model`, default the served model), ends
    `span` (usage, finish reasons, TTFT and queue time; `error.type` when the request fails or its
    client goes away), and keeps `usage` (the tenant's lease) told of the tokens used so far."""
    sequences = [_Sequence(tokenizer, request) for _ in range(request.sampling.n)]
    num_prompt_tokens, num_cached_tokens = len(request.prompt_token_ids), 0
    timer = metrics.METRICS.request_timer(model_name=model)
    metadata = metadata_with_trace_context((), span) if span is not None else ()
    stream = client.generate(to_engine_request(request), metadata=metadata)
    queue_s: float | None = None  # the scheduler's, on its first response
    final: GenerationStep | None = None

    def end_span(error_type: str | None = None) -> None:
        if span is not None:
            end_genai_span(span, input_tokens=num_prompt_tokens,
                           output_tokens=sum(s.num_tokens for s in sequences),
                           finish_reasons=[s.finish_reason for s in sequences if s.finish_reason],
                           time_to_first_token_s=timer.time_to_first_token_s,
                           time_in_queue_s=queue_s, response_id=request.request_id,
                           error_type=error_type)

    answered = False
    try:
        async for response in stream:
            answered = True
            if queue_s is None:
                queue_s = response.queue_seconds
            if response.num_prompt_tokens:
                num_prompt_tokens = response.num_prompt_tokens
                num_cached_tokens = response.num_cached_tokens
            if response.prompt_logprobs:  # once per request: every sequence's next chunk shows them
                for sequence in sequences:
                    sequence.prompt_logprobs = list(response.prompt_logprobs)
            chunks = [sequences[d.index].apply(d, request.sampling.stop_token_ids)
                      for d in response.sequences if d.index < len(sequences)]
            if usage is not None:
                usage.record(num_prompt_tokens + sum(s.num_tokens for s in sequences))
            _raise_on_engine_error(chunks)
            timer.on_tokens(sum(len(c.token_ids) for c in chunks))
            progress = Usage(num_prompt_tokens, sum(s.num_tokens for s in sequences), num_cached_tokens)
            if all(s.finished for s in sequences):
                # The scheduler's timings come with its last response; a stop string ends the
                # request before that one (and aborts it upstream): then the gateway's clock.
                timings = (response.timings if response.HasField("timings")
                           else timings_seen_here(timer, queue_s or 0.0))
                final = GenerationStep(chunks, progress, progress, timings)
                break
            yield GenerationStep(chunks, progress=progress)
        if final is None:
            raise UpstreamError(grpc.StatusCode.INTERNAL,
                                "the scheduler ended the stream before every sequence finished")
    except (GeneratorExit, asyncio.CancelledError):
        end_span("cancelled")  # the client went away
        raise
    except BaseException as error:
        if usage is not None and not answered and isinstance(error, UpstreamError):
            usage.record(0)  # the engine refused it (queue full, shutting down): nothing to charge
        end_span(type(error).__name__)
        raise
    finally:
        # Cancels the call unless it ended: a stop string or a gone client aborts upstream now.
        await stream.aclose()
    timer.finish(queue_s)
    end_span()
    yield final


def timings_seen_here(timer: metrics.RequestTimer, queue_s: float) -> common_pb2.RequestTimings:
    """A request's timings from the gateway's clock and the scheduler's queue time: its time to
    first token and total include the hops to the scheduler, its prefill is what is left of the
    time to first token after the queue."""
    total = time.monotonic() - timer.arrival
    ttft = min(timer.time_to_first_token_s or total, total)
    queue_s = min(queue_s, ttft)
    return common_pb2.RequestTimings(queue_seconds=queue_s, prefill_seconds=ttft - queue_s,
                                     decode_seconds=total - ttft, time_to_first_token_seconds=ttft,
                                     total_seconds=total)


def _raise_on_engine_error(chunks: list[SequenceChunk]) -> None:
    if any(c.finish_reason == "error" for c in chunks):
        raise UpstreamError(grpc.StatusCode.INTERNAL, "the request failed in the engine (worker lost)")
