"""The Worker servicer: Init and the ordered Steps stream, a thin adapter over a step runner.

Ordering and safety (DESIGN.md, protocol principle 4): every plan carries the epoch of the last
Init and step_id = previous + 1. A stale epoch, a step gap or a plan that does not fit the resident
state is answered with `StepResult.error` and changes nothing; the scheduler then resyncs (Init).

Concurrency: the runner is only ever called from one thread, so Init and steps are serialised. On
CPU that thread is the event loop's own (it blocks while a step computes; see `_run_step` for why);
on a GPU it is one helper thread, so the loop receives and decodes the next plan while the device
computes. Either way gRPC buffers the next plans, so the next one is ready the moment a step ends
(this is what pipelining buys).

Pipeline parallelism (a runner with `pipeline_depth` > 1, worker_svc/parallel/tp_worker.py): `submit` runs
only the first stage and returns a future, so the next plan starts on the first stage while later
stages compute this one; results are written in step order as their futures resolve.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc

from pagoda.contract import worker_codec as convert
from pagoda.contract.errors import InvalidRequestError, PlanError, SessionNotFoundError, SnapshotRefusedError
from pagoda.contract.step import StepPlan, StepResult, WorkerInfo
from pagoda.runtime.gc_tuning import freeze_long_lived_objects
from pagoda.runtime.grpc_health import HealthState
from pagoda.runtime.logging import bound_contextvars, get_logger
from pagoda.runtime.step_timeline import StepTimeline
from pagoda.runtime.telemetry import context_from_traceparent, get_tracer, tracing_enabled
from pagoda.v1 import worker_pb2, worker_pb2_grpc

log = get_logger(__name__)
Code = worker_pb2.StepError.Code
_END = object()  # the plan stream ended


class StepRunner(Protocol):
    """What the servicer needs from ModelRunner (or a fake): see worker_svc/model_runner.py.

    `execute` validates the whole plan first and raises PlanError only then, before any state
    changed: a rejected plan leaves the worker exactly as it was."""

    def initialize(self) -> WorkerInfo: ...
    def execute(self, plan: StepPlan) -> StepResult: ...
    def reset(self) -> None: ...


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: StepRunner, health: HealthState) -> None:
        self._runner = runner
        self._health = health
        device = getattr(runner, "device", None)  # the fake runner has none: it computes on CPU
        self._executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-step")
                          if device is not None and device.type != "cpu" else None)
        self._info: WorkerInfo | None = None
        self.epoch = 0
        self._last_step_id: int | None = None  # None: the next plan sets the baseline
        self._needs_init = False  # a step failed half-way: the resident state is unknown
        self._tracer = get_tracer("worker_svc") if tracing_enabled() else None  # None: no span
        self._timeline = StepTimeline("worker")

    async def Init(self, request: worker_pb2.InitRequest, context) -> worker_pb2.InitResponse:
        await self._on_runner_thread(self._init, request)
        # The weights, the cache and the resident state are set; no step is in flight (Init
        # comes between streams): keep the collector's full walks off them for good.
        freeze_long_lived_objects()
        self.epoch = max(time.time_ns(), self.epoch + 1)  # new on every start and every Init
        self._last_step_id = None
        self._needs_init = False
        await self._health.set_serving(True)
        assert self._info is not None
        log.info("worker_initialized", epoch=self.epoch, num_blocks=self._info.num_blocks,
                 block_size=self._info.block_size, max_model_len=self._info.max_model_len)
        return convert.info_to_pb(self._info, self.epoch)

    def _init(self, request: worker_pb2.InitRequest) -> None:
        """Allocate once (the first Init), drop resident state on every Init."""
        if self._info is None:
            if request.max_num_batched_tokens and hasattr(self._runner, "max_num_batched_tokens"):
                self._runner.max_num_batched_tokens = request.max_num_batched_tokens
            if request.max_num_seqs and hasattr(self._runner, "max_num_seqs"):  # the row buckets to warm
                self._runner.max_num_seqs = request.max_num_seqs
            self._info = self._runner.initialize()
        else:
            self._runner.reset()

    async def ReadSnapshot(self, request: worker_pb2.ReadSnapshotRequest, context) -> worker_pb2.SnapshotListing:
        """What a session snapshot holds (worker_svc/disk_tier/snapshots.py), for the scheduler's
        restore. Reads files only, on a helper thread, beside the steps."""
        store = getattr(self._runner, "snapshots", None)
        if store is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this worker has no --kv-snapshot-dir")
        try:
            tokens, num_blocks, num_bytes = await asyncio.to_thread(store.listing, request.name, request.verify)
        except SessionNotFoundError as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except SnapshotRefusedError as error:
            log.warning("session_snapshot_refused", snapshot=request.name, reason=str(error))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"session snapshot refused: {error}")
        return worker_pb2.SnapshotListing(token_ids=tokens, num_blocks=num_blocks, num_bytes=num_bytes)

    async def Steps(self, request_iterator, context) -> None:
        plans: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._read_plans(request_iterator, plans))
        log.info("steps_stream_opened", epoch=self.epoch)
        if getattr(self._runner, "pipeline_depth", 1) > 1:
            try:
                await self._pipelined_steps(plans, context)
            finally:
                reader.cancel()
                log.info("steps_stream_closed", epoch=self.epoch, last_step_id=self._last_step_id)
            return
        writing: asyncio.Task | None = None  # the last result's write, still in flight
        try:
            while (item := await plans.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                plan_pb, received = item
                started = time.perf_counter()
                result_pb = await self._run_step(plan_pb)
                encoded = time.perf_counter()
                if writing is not None:
                    await writing  # one write at a time per call; long done by now: a step ran since
                writing = await self._start_write(context, result_pb)
                if self._timeline.enabled:
                    self._record(plan_pb, received, started, encoded)
            if writing is not None:
                await writing
        finally:
            reader.cancel()
            if writing is not None and not writing.done():
                writing.cancel()
            log.info("steps_stream_closed", epoch=self.epoch, last_step_id=self._last_step_id)

    async def _pipelined_steps(self, plans: asyncio.Queue, context) -> None:
        """Submit each plan as it comes (first stage only); a writer task awaits the results in
        step order. A rejected plan's error takes its place in that order."""
        results: asyncio.Queue = asyncio.Queue()  # awaitables of result protos, in step order
        writer = asyncio.create_task(self._write_in_order(results, context))
        try:
            while (item := await plans.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                results.put_nowait((item[0].step_id, await self._submit_step(item[0])))
                if writer.done():  # the stream broke: stop submitting
                    break
        finally:
            results.put_nowait(None)
            await writer

    async def _submit_step(self, plan_pb: worker_pb2.StepPlan):
        """The awaitable of this plan's result proto (done at once when the plan is refused)."""
        done = asyncio.get_running_loop().create_future()
        with bound_contextvars(step_id=plan_pb.step_id):
            rejection, plan = self._decode_in_order(plan_pb)
            if rejection is None:
                try:
                    future = await self._on_runner_thread(self._runner.submit, plan)
                except PlanError as error:
                    rejection = (Code.INVALID_PLAN, str(error))
                except Exception as error:  # noqa: BLE001 - the group failed: reported in-band
                    log.exception("step_failed", error=str(error))
                    self._needs_init = True
                    rejection = (Code.INTERNAL, f"step failed: {error}")
            if rejection is not None:
                log.warning("plan_rejected", code=Code.Name(rejection[0]), reason=rejection[1])
                done.set_result(convert.error_result_pb(plan_pb.step_id, *rejection))
                return done
        self._last_step_id = plan_pb.step_id
        return asyncio.wrap_future(future)

    async def _write_in_order(self, results: asyncio.Queue, context) -> None:
        while (item := await results.get()) is not None:
            step_id, pending = item
            try:
                result = await pending
            except Exception as error:  # noqa: BLE001 - a rank died: the step's error, in-band
                self._needs_init = True
                result_pb = convert.error_result_pb(step_id, Code.INTERNAL, f"step failed: {error}")
            else:
                if isinstance(result, worker_pb2.StepResult):
                    result_pb = result
                else:
                    result_pb = convert.result_to_pb(result)
                    result_pb.num_resident_requests = getattr(self._runner, "num_resident", 0)
            await context.write(result_pb)

    @staticmethod
    async def _start_write(context, result_pb: worker_pb2.StepResult) -> asyncio.Task:
        """Hand the result to gRPC and return without waiting for the write to complete.

        Yielding the result from an async generator (as this servicer did) resumes it only once gRPC
        reports the write done: a hop through gRPC's completion-queue thread and back to this loop,
        between the end of one forward and the start of the next (13 ms per token on a busy 2-core
        machine, benchmarks/step_timeline.py). One pass of the loop lets the task submit the write
        (the send op starts inside `context.write` before its first suspension); its completion
        is collected before the next write."""
        writing = asyncio.ensure_future(context.write(result_pb))
        await asyncio.sleep(0)  # a yield to the loop, not a wait: the task submits the write now
        return writing

    @staticmethod
    async def _read_plans(request_iterator, plans: asyncio.Queue) -> None:
        """Receive the next plans while the current step computes."""
        try:
            async for plan_pb in request_iterator:
                plans.put_nowait((plan_pb, time.perf_counter()))
        except Exception as error:  # noqa: BLE001 - handed to the stream loop, which re-raises
            plans.put_nowait(error)
        plans.put_nowait(_END)

    def _record(self, plan_pb: worker_pb2.StepPlan, received: float, started: float, encoded: float) -> None:
        """One timeline line (pagoda/runtime/step_timeline.py); `written` is when the result had been
        handed to gRPC, so the next step could start."""
        marks = getattr(self._runner, "marks", None)  # the fake runner has none
        fresh = marks is not None and marks.started >= started  # else a step without a forward
        parts = {} if not fresh else {"execute": marks.started, "inputs_built": marks.inputs_built,
                                      "logits_done": marks.logits_done, "sampled": marks.sampled}
        decode = not plan_pb.new_requests and not plan_pb.num_scheduled_tokens  # one token each
        self._timeline.record(step=plan_pb.step_id, decode=decode, received=received, started=started,
                              **parts, encoded=encoded, written=time.perf_counter())

    async def _run_step(self, plan_pb: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        step_id = plan_pb.step_id
        with bound_contextvars(step_id=step_id):
            rejection, plan = self._decode_in_order(plan_pb)
            if rejection is not None:
                log.warning("plan_rejected", code=Code.Name(rejection[0]), reason=rejection[1])
                return convert.error_result_pb(step_id, *rejection)
            return await self._on_runner_thread(self._execute, plan)

    def _decode_in_order(self, plan_pb: worker_pb2.StepPlan) -> tuple[tuple[int, str] | None, StepPlan | None]:
        """(rejection, None) for a plan out of order or with bad sampling params, else (None, plan)."""
        rejection = self._check_order(plan_pb)
        if rejection is not None:
            return rejection, None
        try:
            return None, convert.plan_from_pb(plan_pb)[1]
        except InvalidRequestError as error:
            return (Code.INVALID_PLAN, f"bad sampling params: {error}"), None

    async def _on_runner_thread(self, fn, *args):
        # CPU: on the event loop's own thread, blocking it, on purpose. With the steps on a helper
        # thread, every wake-up of the loop thread (a plan arriving, the result future, a health
        # probe) took a core from the compute threads on a small machine and stalled the whole
        # OpenMP team, and the two threads traded the GIL around every op: the worker kept 1.55 of
        # 2 cores busy instead of 1.9 and served ~10% fewer tokens/s (benchmarks/services_cost.py).
        # The cost: health probes and GetStats wait for the step in progress to end.
        if self._executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _check_order(self, plan_pb: worker_pb2.StepPlan) -> tuple[int, str] | None:
        if self._info is None:
            return Code.STALE_EPOCH, "the worker is not initialised: call Init first"
        if self._needs_init:
            return Code.STALE_EPOCH, "a step failed and left the state unknown: call Init"
        if plan_pb.epoch != self.epoch:
            return Code.STALE_EPOCH, f"plan epoch {plan_pb.epoch} is not the worker's epoch {self.epoch}"
        last = self._last_step_id
        if last is not None and plan_pb.step_id != last + 1:
            return Code.STEP_GAP, f"step {plan_pb.step_id} does not follow step {last}"
        return None

    def _execute(self, plan: StepPlan) -> worker_pb2.StepResult:
        """The runner validates once, before any state changes."""
        try:
            result = self._traced_execute(plan) if self._tracer else self._runner.execute(plan)
        except PlanError as error:  # rejected before anything changed: the state is intact
            log.warning("plan_rejected", code="INVALID_PLAN", reason=str(error))
            return convert.error_result_pb(plan.step_id, Code.INVALID_PLAN, str(error))
        except Exception as error:  # noqa: BLE001 - reported in-band; the scheduler resyncs
            log.exception("step_failed", error=str(error))
            self._needs_init = True
            return convert.error_result_pb(plan.step_id, Code.INTERNAL, f"step failed: {error}")
        self._last_step_id = plan.step_id
        result_pb = convert.result_to_pb(result)
        # Observable proof that finished / aborted requests were dropped (GetStats, soak tests).
        result_pb.num_resident_requests = getattr(self._runner, "num_resident", 0)
        return result_pb

    def _traced_execute(self, plan: StepPlan) -> StepResult:
        """execute() inside `worker.execute`, a child of the scheduler's step span. An exception
        is recorded on the span (marked as an error) and propagates to the caller's handler."""
        with self._tracer.start_as_current_span(
                "worker.execute", context=context_from_traceparent(plan.traceparent),
                attributes={"pagoda.step.step_id": plan.step_id}) as span:
            result = self._runner.execute(plan)
            span.set_attributes({"pagoda.worker.forward_seconds": result.forward_seconds,
                                 "pagoda.worker.sample_seconds": result.sample_seconds})
            return result
