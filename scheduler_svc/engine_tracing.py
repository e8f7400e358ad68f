"""The engine loop's spans: one `scheduler.request` per request, one `scheduler.step` per plan.

The engine loop calls the same hooks whether tracing is on or off: `engine_tracing()` returns
`NoTracing` (every hook returns at once, no span object is ever built) unless `setup_tracing`
installed a provider. Shape (docs/observability.md):
- `scheduler.request`: child of the gateway's span (gRPC metadata); events queued, scheduled,
  preempted, first_token, finished, each with the step_id it happened in where there is one.
- `scheduler.step`: a root span per plan, linked to the request span of every request the plan
  computes tokens for; its traceparent rides in the plan, so `worker.execute` is its child.
  It ends when the step's result has been applied (or the worker was lost). Events
  `brownout_entered` / `brownout_exited` mark the step a brownout transition happened at.
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, Tracer

from pagoda.contract.ids import RequestId
from pagoda.contract.step import StepPlan
from pagoda.runtime.telemetry import (
    RequestSpans,
    StepSpanStats,
    get_tracer,
    inject_traceparent,
    start_step_span,
    tracing_enabled,
)
from scheduler_svc.core.brownout import BrownoutChange
from scheduler_svc.core.request import EngineRequest
from scheduler_svc.core.scheduler import Scheduler


class NoTracing:
    """Tracing off: every hook is a no-op (the per-step cost is one method call)."""

    def request_added(self, request: EngineRequest, parent: otel_context.Context | None) -> None:
        pass

    def plan_sent(self, plan: StepPlan, scheduler: Scheduler) -> None:
        pass

    def step_reported(self, step_id: int, scheduler: Scheduler | None = None) -> None:
        pass

    def first_token(self, request_id: RequestId) -> None:
        pass

    def brownout_changed(self, step_id: int, change: BrownoutChange) -> None:
        pass

    def finished(self, request_id: RequestId, reason: str) -> None:
        pass

    def worker_lost(self) -> None:
        pass


class EngineTracing(NoTracing):
    def __init__(self, tracer: Tracer | None = None) -> None:  # tracer: tests pass their own
        self._tracer = tracer or get_tracer("scheduler_svc")
        self._requests = RequestSpans(self._tracer)
        self._steps: dict[int, Span] = {}  # open step spans by step id (at most the in-flight ones)
        self._prefix_hits_seen = 0  # the core's prefix_hits counter at the previous step
        self._spec_seen = (0, 0)  # the core's (draft tokens, accepted tokens) at the last report

    def request_added(self, request: EngineRequest, parent: otel_context.Context | None) -> None:
        self._requests.start(request.request_id, parent, {
            "gen_ai.request.max_tokens": request.sampling.max_tokens or 0,
            "gen_ai.request.choice.count": request.sampling.n,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids)})

    def plan_sent(self, plan: StepPlan, scheduler: Scheduler) -> None:
        """Call right after schedule() returned `plan` (nothing may change in between); sets
        `plan.traceparent`."""
        step = {"step_id": plan.step_id}
        for new in plan.new_requests:
            self._requests.event(self._request_of(new.request_id), "scheduled", step)
        for seq_id in plan.preempted_ids:
            self._requests.event(self._request_of(seq_id), "preempted", step)
        s = scheduler.stats()
        span = start_step_span(self._tracer, StepSpanStats(
            step_id=plan.step_id, num_running=s.num_running, num_waiting=s.num_waiting,
            prefill_tokens=s.last_step_prefill_tokens, decode_tokens=s.last_step_decode_tokens,
            num_preemptions=s.last_step_preemptions, kv_cache_usage=s.kv_usage,
            prefix_cache_hit_tokens=max(s.prefix_hits - self._prefix_hits_seen, 0),
            swapped_out_blocks=len(plan.swap_out), swapped_in_blocks=len(plan.swap_in)),
            served=self._requests.span_contexts(scheduler.running_request_ids(plan)))
        self._prefix_hits_seen = s.prefix_hits
        if s.last_step_images:  # vision-language models: the images this step encodes (docs/vision.md)
            span.set_attribute("pagoda.step.images", [h[:16] for h in s.last_step_images])
        plan.traceparent = inject_traceparent(span)
        self._steps[plan.step_id] = span

    def step_reported(self, step_id: int, scheduler: Scheduler | None = None) -> None:
        """`scheduler`: the core right after update() applied this step (its drafts' acceptance)."""
        if (span := self._steps.pop(step_id, None)) is None:
            return
        if scheduler is not None and scheduler.spec_num_draft_tokens != self._spec_seen[0]:
            drafted = scheduler.spec_num_draft_tokens - self._spec_seen[0]
            accepted = scheduler.spec_num_accepted_tokens - self._spec_seen[1]
            span.set_attributes({"pagoda.step.spec_draft_tokens": drafted,
                                 "pagoda.step.spec_accepted_tokens": accepted,
                                 "pagoda.step.spec_acceptance_rate": accepted / drafted})
            self._spec_seen = (scheduler.spec_num_draft_tokens, scheduler.spec_num_accepted_tokens)
        span.end()

    def first_token(self, request_id: RequestId) -> None:
        self._requests.event(request_id, "first_token")

    def brownout_changed(self, step_id: int, change: BrownoutChange) -> None:
        """Event `brownout_entered` / `brownout_exited` on the step span it happened at."""
        if (span := self._steps.get(step_id)) is not None:
            span.add_event("brownout_entered" if change.active else "brownout_exited", {
                "pagoda.brownout.reason": change.reason,
                "pagoda.brownout.kv_usage": change.kv_usage,
                "pagoda.brownout.preemptions_in_window": change.preemptions_in_window})

    def finished(self, request_id: RequestId, reason: str) -> None:
        self._requests.finish(request_id, reason)

    def worker_lost(self) -> None:
        """The in-flight steps will never report: end their spans now (step ids restart at 1)."""
        for span in self._steps.values():
            span.set_attribute("error.type", "worker_lost")
            span.end()
        self._steps.clear()

    def _request_of(self, seq_id: RequestId) -> RequestId:
        """A plan names sequences; a fork child's id is `{request_id}#{index}` (request.py)."""
        if seq_id in self._requests or "#" not in seq_id:
            return seq_id
        return RequestId(seq_id.rpartition("#")[0])


def engine_tracing() -> NoTracing:
    """EngineTracing when `setup_tracing` turned tracing on, else the no-op hooks."""
    return EngineTracing() if tracing_enabled() else NoTracing()
