"""The scheduler's asyncio engine loop: schedule -> send plan -> await result -> update -> stream.

Two tasks share one Steps stream: the sender schedules and writes plans while fewer than
`max_inflight_steps` are in flight (2 = pipelining: the next plan leaves before the last result is
back), the receiver applies results in step order and pushes each request's deltas to its queue.
When there is nothing to do the sender sleeps on `_wake` (set by new requests, aborts and results),
never by polling. Both tasks call the (synchronous) core between awaits, so the core never sees
concurrent calls.

Worker loss (stream error or an in-band rejection): `reset_after_worker_loss()`, reconnect (Init =
new epoch) with backoff and recompute; requests are failed with UNAVAILABLE only when the worker
is not back within `worker_timeout_s`. A step the worker failed (INTERNAL: its forward pass or
sampler raised) is first reported to the core, which convicts the request that makes steps fail
and runs the other suspects alone until they are cleared (core/poison.py): no resync loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, defaultdict

import grpc

from pagoda.contract.errors import (
    DuplicateRequestError,
    RequestFailedError,
    ShuttingDownError,
    WorkerUnavailableError,
)
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason
from pagoda.contract.step import StepPlan
from pagoda.runtime.gc_tuning import freeze_long_lived_objects
from pagoda.runtime.logging import get_logger
from pagoda.runtime.step_timeline import StepTimeline
from pagoda.v1 import common_pb2
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.request import EngineRequest
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.tiers.snapshots import SessionSave
from scheduler_svc.engine_tracing import engine_tracing
from scheduler_svc.request_stream import RequestStream, StreamUpdate
from scheduler_svc.worker_client import PlanRejectedError, StepStream, WorkerClient, WorkerLostError

log = get_logger(__name__)


class EngineLoop:
    def __init__(self, scheduler: Scheduler, client: WorkerClient, *, worker_timeout_s: float = 30.0,
                 on_health=None) -> None:
        self.scheduler = scheduler
        self._client = client
        self._worker_timeout_s = worker_timeout_s
        self._on_health = on_health  # async callable(bool): flips grpc health
        self._streams: dict[RequestId, RequestStream] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self.draining = False  # SIGTERM: refuse new requests, let the running ones finish
        self._failed = False  # the worker stayed away past the timeout: reject new requests
        self.connected = False
        self.num_steps = 0
        self.step_seconds_sum = 0.0
        self.request_success: Counter[str] = Counter()
        self.invariant_ok = True  # the result of the last check made while idle
        self._sent_at: dict[int, float] = {}
        self._last_result_at = 0.0
        self._tracing = engine_tracing()  # no-op hooks unless tracing is on
        self._timeline = StepTimeline("scheduler")
        self._plan_marks: dict[int, tuple[float, float, float]] = {}  # only with the timeline on
        self._saves: dict[SessionSave, asyncio.Future] = {}  # session saves until their step reports

    # -- requests (called by the servicer) --------------------------------------------------------

    def add_request(self, request: EngineRequest, trace_parent=None) -> RequestStream:
        """Raises DuplicateRequestError, WorkerUnavailableError, InvalidRequestError, QueueFullError."""
        if self._stopping or self.draining:
            raise ShuttingDownError("the engine is shutting down")
        if self._failed:
            raise WorkerUnavailableError("no worker is connected")
        if request.request_id in self._streams:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already running")
        self.scheduler.add_request(request)
        stream = RequestStream(request.request_id, request.sampling.n, time.monotonic())
        self._streams[request.request_id] = stream
        self._tracing.request_added(request, trace_parent)  # trace_parent: the caller's context
        log.info("request_added", request_id=request.request_id, num_prompt_tokens=len(
            request.prompt_token_ids), n=request.sampling.n, max_tokens=request.sampling.max_tokens)
        self._wake.set()
        return stream

    def abort(self, request_id: RequestId, reason: str = "abort_rpc") -> bool:
        """Abort now; blocks still used by an in-flight step are freed when it reports."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self._dispatch(self.scheduler.abort(request_id))
        if not stream.done:  # the core had nothing left to report: close the stream ourselves
            self._close(stream, [SequenceDelta(request_id, i, finish_reason=FinishReason.ABORT)
                                 for i in range(stream.n)], FinishReason.ABORT)
        log.info("request_aborted", request_id=request_id, reason=reason)
        self._wake.set()  # the next plan tells the worker to drop the request
        return True

    def migrate(self, request_id: RequestId) -> bool:
        """Live migration (core/tiers/migration.py): export the request's KV and end its stream with
        MIGRATED and the handoff; the gateway carries it on on another replica. False if unknown."""
        if request_id not in self._streams:
            return False
        migration_id = uuid.uuid4().hex
        deltas = self.scheduler.export_request(request_id, migration_id)
        if deltas is None:
            return False
        self._dispatch(deltas)  # a waiting request ends now; a running one when its export step reports
        log.info("request_migrating", request_id=request_id, migration_id=migration_id)
        self._wake.set()
        return True

    def end_session(self, cache_salt: str | None, session_id: str) -> bool:
        """End a session's lease now (its blocks become ordinary cached blocks)."""
        found = self.scheduler.end_session(cache_salt, session_id)
        log.info("session_ended", session_id=session_id, found=found)
        return found

    def save_session(self, cache_salt: str | None, session_id: str, name: str) -> asyncio.Future | None:
        """Save a session lease's blocks as snapshot `name` (core/tiers/snapshots.py): a future of the
        SessionSave, set when its step reported (WorkerUnavailableError if the worker was lost
        first). None: the session holds no lease here."""
        if self._failed or self._stopping:
            raise WorkerUnavailableError("no worker is connected")
        save = self.scheduler.save_session(cache_salt, session_id, name)
        if save is None:
            return None
        future = asyncio.get_running_loop().create_future()
        self._saves[save] = future
        self._wake.set()
        return future

    def _settle_saves(self) -> None:
        for save in self.scheduler.take_saved_sessions():
            future = self._saves.pop(save, None)
            if future is None or future.done():
                continue
            if save.ok:
                future.set_result(save)
            else:
                future.set_exception(WorkerUnavailableError("the worker was lost before the session was saved"))

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_unfinished_requests() and self.scheduler.num_inflight_steps == 0

    @property
    def worker_resident_requests(self) -> int:
        return self._client.worker_resident_requests

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until stop(): one Steps stream per worker epoch, resync on loss."""
        freeze_long_lived_objects()
        while not self._stopping:
            stream = self._client.open_stream()
            self._set_connected(True)
            try:
                await self._serve(stream)
            except PlanRejectedError as error:
                log.warning("step_failed", worker=self._client.target, step_id=error.step_id,
                            code=error.code, error=error.message)
                if error.code == "INTERNAL":
                    self._dispatch(self.scheduler.note_step_failure(error.step_id, error.message))
            except WorkerLostError as error:
                log.warning("worker_lost", worker=self._client.target, error=str(error),
                            num_inflight_steps=self.scheduler.num_inflight_steps)
            except Exception as error:  # noqa: BLE001 - a bug: fail what is running, resync, go on
                log.exception("engine_step_failed", error=str(error))
                self._fail_all(RuntimeError(f"internal error: {error}"))
            finally:
                stream.cancel()
            if self._stopping:
                break
            self._set_connected(False)
            self.scheduler.reset_after_worker_loss()
            self._dispatch(self.scheduler.take_migrated_after_loss())  # they recompute on their target
            self._settle_saves()  # the loss failed the saves in flight
            self._sent_at.clear()
            self._plan_marks.clear()
            self._tracing.worker_lost()
            await self._reconnect()

    async def _serve(self, stream: StepStream) -> None:
        self._wake.set()  # schedule whatever is waiting (also after a resync)
        tasks = [asyncio.create_task(self._send_loop(stream)),
                 asyncio.create_task(self._recv_loop(stream))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # re-raise WorkerLostError (or a bug)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send_loop(self, stream: StepStream) -> None:
        max_inflight = self.scheduler.max_inflight_steps
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.scheduler.num_inflight_steps < max_inflight:
                scheduling = time.perf_counter()
                plan = self.scheduler.schedule()
                if plan is None:
                    break
                self._note_sent(plan)
                planned = time.perf_counter()
                await stream.send(plan)
                if self._timeline.enabled:
                    self._plan_marks[plan.step_id] = (scheduling, planned, time.perf_counter())

    async def _recv_loop(self, stream: StepStream) -> None:
        while True:
            result = await stream.recv()
            received = time.perf_counter()
            now = time.monotonic()
            started = max(self._sent_at.pop(result.step_id, now), self._last_result_at)
            self.step_seconds_sum += now - started
            self._last_result_at = now
            self.num_steps += 1
            self._dispatch(self.scheduler.update(result))
            if self._saves:
                self._settle_saves()
            if self.scheduler.brownout_active and self.idle:
                self.scheduler.brownout_idle()  # no more steps will come to recover with
            if self.scheduler.brownout_changes:
                self._brownout_changed(result.step_id)
            self._tracing.step_reported(result.step_id, self.scheduler)
            if self._timeline.enabled:
                self._record(result.step_id, received)
            if self.idle:
                self.check_invariants()
                freeze_long_lived_objects()  # what survives a drained engine is long-lived
            self._wake.set()

    def _record(self, step_id: int, received: float) -> None:
        """One timeline line (pagoda/runtime/step_timeline.py): when the plan was scheduled, built and
        written, when its result was read and when its tokens were handed to the callers' queues."""
        scheduling, planned, sent = self._plan_marks.pop(step_id, (0.0, 0.0, 0.0))
        self._timeline.record(step=step_id, scheduling=scheduling, planned=planned, sent=sent,
                              received=received, dispatched=time.perf_counter())

    def _note_sent(self, plan: StepPlan) -> None:
        now = time.monotonic()
        self._sent_at[plan.step_id] = now
        for new in plan.new_requests:
            stream = self._streams.get(new.request_id)
            if stream is not None and stream.first_scheduled is None:
                stream.first_scheduled = now
        self._tracing.plan_sent(plan, self.scheduler)  # sets plan.traceparent
        if self.scheduler.brownout_changes:  # decided by the schedule() that made this plan
            self._brownout_changed(plan.step_id)

    def _brownout_changed(self, step_id: int) -> None:
        """Log each brownout transition and put it on the step span (rare: not per step)."""
        changes, config = self.scheduler.brownout_changes, self.scheduler.config
        while changes:
            change = changes.popleft()
            fields = dict(step_id=step_id, reason=change.reason, kv_usage=round(change.kv_usage, 4),
                          preemptions_in_window=change.preemptions_in_window)
            if change.active:
                log.warning("brownout_entered", **fields, max_tokens=config.brownout.max_tokens,
                            max_num_batched_tokens=self.scheduler.step_budget)
            else:
                log.info("brownout_exited", **fields)
            self._tracing.brownout_changed(step_id, change)

    async def _reconnect(self) -> None:
        """Init again with backoff; fail every request once the worker is away too long."""
        deadline = time.monotonic() + self._worker_timeout_s
        while not self._stopping:
            try:
                info = await self._client.connect(timeout_s=max(deadline - time.monotonic(), 1.0))
                # The disk tier's files outlive the worker: its Init lists them (the index was reset).
                self.scheduler.restore_disk_tier(info.disk_blocks)
                self._failed = False
                log.info("worker_reconnected", worker=self._client.target)
                return
            except WorkerUnavailableError as error:
                if not self._failed:
                    self._fail_all(error)
            except grpc.aio.AioRpcError as error:  # the worker answers but Init failed: retry
                log.error("worker_init_failed", worker=self._client.target, code=error.code().name,
                          details=error.details())
                if not self._failed and time.monotonic() >= deadline:
                    self._fail_all(WorkerUnavailableError(f"worker Init failed: {error.details()}"))
                await asyncio.sleep(1.0)  # back off before the next Init

    def _fail_all(self, error: Exception) -> None:
        self._failed = True
        self._dispatch(self.scheduler.fail_all(str(error)))
        self._settle_saves()
        for stream in list(self._streams.values()):  # sequences the core did not report
            self._streams.pop(stream.request_id)
            stream.done = True
            stream.queue.put_nowait(error)
            self._tracing.finished(stream.request_id, "error")
        log.error("requests_failed", reason=str(error))
        self._notify_health(False)

    # -- fan-out ----------------------------------------------------------------------------------

    def _dispatch(self, deltas: list[SequenceDelta]) -> None:
        by_request: dict[RequestId, list[SequenceDelta]] = defaultdict(list)
        for delta in deltas:
            by_request[delta.request_id].append(delta)
        for request_id, request_deltas in by_request.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # already closed (aborted by its caller)
            failed = next((d for d in request_deltas if d.finish_reason == FinishReason.ERROR), None)
            if failed is not None:
                self._streams.pop(request_id)
                stream.done = True
                stream.queue.put_nowait(WorkerUnavailableError("the worker was lost") if failed.error is None
                                        else RequestFailedError(f"the model failed on this request: {failed.error}"))
                self._tracing.finished(request_id, "error")
                continue
            if not stream.sent_first and request_deltas[0].new_token_ids:
                self._tracing.first_token(request_id)
            if stream.first_token is None and any(d.new_token_ids for d in request_deltas):
                stream.first_token = time.monotonic()
            stream.num_finished += sum(d.finished for d in request_deltas)
            if stream.num_finished >= stream.n:
                self._close(stream, request_deltas, request_deltas[-1].finish_reason)
            else:
                stream.queue.put_nowait(self._update(stream, request_deltas, finished=False))

    def _close(self, stream: RequestStream, deltas: list[SequenceDelta], reason) -> None:
        self._streams.pop(stream.request_id, None)
        stream.done = True
        stream.queue.put_nowait(self._update(stream, deltas, finished=True))
        reason_name = reason.value if reason is not None else "none"
        self.request_success[reason_name] += 1
        self._tracing.finished(stream.request_id, reason_name)
        log.info("request_finished", request_id=stream.request_id, finish_reason=reason_name,
                 e2e_seconds=round(time.monotonic() - stream.arrival, 6))

    @staticmethod
    def _update(stream: RequestStream, deltas: list[SequenceDelta], finished: bool) -> StreamUpdate:
        update = StreamUpdate(deltas, finished)
        if not stream.sent_first:
            stream.sent_first = True
            started = stream.first_scheduled or time.monotonic()
            update.queue_seconds = max(started - stream.arrival, 0.0)
        if finished:
            update.timings = request_timings(stream, time.monotonic())
        return update

    # -- health and shutdown ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        try:
            self.scheduler.check_invariants()
            self.invariant_ok = True
        except Exception as error:  # noqa: BLE001 - reported through GetStats and the log
            self.invariant_ok = False
            log.error("invariant_violated", error=str(error))

    def _set_connected(self, connected: bool) -> None:
        self.connected = connected
        if connected:
            self._notify_health(True)

    def _notify_health(self, serving: bool) -> None:
        if self._on_health is not None:
            asyncio.get_running_loop().create_task(self._apply_health(serving))

    async def _apply_health(self, serving: bool) -> None:
        # Invariant: once draining (or stopping), health stays NOT_SERVING, even when the worker
        # reconnects. Checked when the task runs, not when it was created, so a flip queued just
        # before SIGTERM cannot land after drain() turned health off.
        await self._on_health(serving and not (self.draining or self._stopping))

    def stop(self) -> None:
        """End the loop. Requests still running (past the drain) end with UNAVAILABLE "shutting
        down", a status a client can retry on, rather than as calls the server cancels."""
        self._stopping = True
        self._wake.set()
        if not self._streams:
            return
        error = ShuttingDownError("the scheduler stopped before this request finished; retry it")
        self.scheduler.fail_all(str(error))
        for stream in list(self._streams.values()):
            self._streams.pop(stream.request_id)
            stream.done = True
            stream.queue.put_nowait(error)
            self._tracing.finished(stream.request_id, "error")
        log.warning("requests_failed", reason=str(error))


def request_timings(stream: RequestStream, now: float) -> common_pb2.RequestTimings:
    """The finished request's timings from its stream's instants; one never scheduled or without a
    token (aborted early) counts the missing instants as `now`, so every figure stays >= 0 and
    queue + prefill = time to first token, time to first token + decode = total, exactly."""
    scheduled = min(stream.first_scheduled or now, now)
    first_token = min(max(stream.first_token or now, scheduled), now)
    arrival = min(stream.arrival, scheduled)
    return common_pb2.RequestTimings(
        queue_seconds=scheduled - arrival, prefill_seconds=first_token - scheduled,
        decode_seconds=now - first_token, time_to_first_token_seconds=first_token - arrival,
        total_seconds=now - arrival)
