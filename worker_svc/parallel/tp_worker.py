"""Rank 0 of a tensor- / pipeline-parallel worker group: starts the other ranks and drives them.

    scheduler --gRPC--> rank 0 (WorkerServicer + TPDriver) --broadcast--> ranks 1..N-1 (tp_rank.py)

The driver is a StepRunner (worker_svc/service.py): the servicer (or the offline LLM) calls it as
it would a ModelRunner. Each command (init, reset, step, stop) is broadcast once, then every rank
runs it; one rank samples (rank 0 with one stage, the last stage's first rank with several) and the
tokens it drew ride, as (step id, tokens), on a later step's message.

Pipeline parallelism: `submit` broadcasts a plan and runs stage 0's layers, then returns a future;
the last stage sends the result back, and a thread of the driver's hands it to that future. So the
servicer can submit the next plan while later stages still compute this one: up to
`pipeline_depth` plans are in the group at once (the scheduler never puts a sequence whose sampled
token is still in flight into the next plan, scheduler_svc/core/scheduler.py).

Where the other ranks live: processes this host starts (the `mp` backend; with `--nnodes` only this
node's ranks, the other nodes' launchers start theirs, worker_svc/parallel/multinode.py), or Ray actors
(worker_svc/parallel/ray_ranks.py).

Failure: a rank that dies (its process exits, or a collective raises) leaves the group unusable.
A server (exit_on_failure=True) then kills the other ranks and exits non-zero, so the launcher /
compose restarts it and the scheduler's reconnect path resyncs; the offline LLM gets a
TensorParallelError instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path

import torch

from pagoda.contract.errors import PlanError
from pagoda.contract.step import StepPlan, StepResult, WorkerInfo
from pagoda.runtime.logging import get_logger
from worker_svc.config import WorkerConfig
from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.model_runner import ModelRunner, resolve_device
from worker_svc.parallel.channels import command_channel
from worker_svc.parallel.distributed import (
    TensorParallelError,
    check_divisible,
    cpu_threads_per_rank,
    destroy_group,
    init_groups,
)
from worker_svc.parallel.liveness import HEARTBEAT_S, Listener, store_client
from worker_svc.parallel.multinode import Placement, rank_argv
from worker_svc.parallel.pipeline import partition_layers, stage_of

log = get_logger(__name__)
REPO = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 10.0


def create_runner(config: WorkerConfig, max_num_batched_tokens: int = 8192,
                  exit_on_failure: bool = False) -> ModelRunner | TPDriver:
    """A plain ModelRunner for one rank (no collectives at all), else a TP x PP group."""
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return ModelRunner(config, max_num_batched_tokens)
    return TPDriver(config, max_num_batched_tokens, exit_on_failure)


class TPDriver:
    def __init__(self, config: WorkerConfig, max_num_batched_tokens: int,
                 exit_on_failure: bool) -> None:
        model_config = ModelConfig.from_dir(config.model)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        check_divisible(model_config.num_heads, model_config.num_kv_heads,
                        model_config.intermediate_size, tp, model_config.moe_intermediate_size)
        partition_layers(model_config.num_layers, pp)  # a clear error for too many stages, at once
        self.placement = placement = Placement.of(config)
        self.pipeline_depth = pp
        self._exit_on_failure = exit_on_failure
        self._lock = threading.Lock()  # one command at a time on the control group
        self._fail_lock = threading.Lock()
        self._stopping = False
        self._failure: str | None = None
        # (step id, tokens, their request ids where the step verified drafts): not yet sent to the followers
        self._sampled: list[tuple[int, list[int], list | None]] = []
        self._drafting: set[int] = set()  # submitted steps that carry drafts
        self._sampled_lock = threading.Lock()
        self._inflight: list[Future] = []  # submitted steps whose result has not come back
        device = resolve_device(config.device, 0, placement.world_size)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(placement.ranks_per_node))
        self._expected: queue.SimpleQueue = queue.SimpleQueue()  # (step id, future), in step order
        self._children: list[subprocess.Popen] = []
        self._actors = None  # the Ray backend's (worker_svc/parallel/ray_ranks.py)
        if config.distributed_executor_backend == "ray":
            from worker_svc.parallel.ray_ranks import RayRanks

            self._actors = RayRanks(config, placement, self._fail)
        else:
            self._children = [self._spawn(rank, config) for rank in placement.local_ranks(0)[1:]]
        for child in self._children:
            threading.Thread(target=self._watch, args=(child,), daemon=True,
                             name=f"tp-watch-{child.pid}").start()
        try:
            init_method = self._actors.init_method if self._actors else placement.init_method
            groups = init_groups(0, placement.world_size, tp, init_method, device)
            self.tp = groups.tp
            self.stage = stage_of(0, tp, pp, model_config.num_layers, groups.pipe_group, groups.result_group)
            self._channel = command_channel(groups)
            # Every rank runs rank 0's config (another node's launch knows only its own flags);
            # only where it runs is its own (worker_svc/parallel/multinode.py adopt_config).
            self._channel.send(("config", dataclasses.asdict(config)))
            self.runner = ModelRunner(config, max_num_batched_tokens, self.tp, self.stage)
        except BaseException:
            self._kill_children()
            destroy_group()
            raise
        if pp > 1:
            threading.Thread(target=self._collect_results, daemon=True, name="pp-results").start()
        self._last_command = time.monotonic()
        self._listener = Listener(store_client(init_method), range(1, placement.world_size))
        threading.Thread(target=self._heartbeat, daemon=True, name="rank0-heartbeat").start()
        atexit.register(self.close)
        log.info("tp_group_ready", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                 nnodes=placement.nnodes, backend=config.distributed_executor_backend,
                 device=str(self.runner.device), pids=[c.pid for c in self._children],
                 ray_nodes=self._actors.node_ids if self._actors else None)

    # -- StepRunner -----------------------------------------------------------------------------

    @property
    def max_num_batched_tokens(self) -> int:
        return self.runner.max_num_batched_tokens

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, value: int) -> None:
        self.runner.max_num_batched_tokens = value

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def follower_pids(self) -> list[int]:
        return [child.pid for child in self._children]

    @property
    def rank_node_ids(self) -> list[str]:
        """Ray node id of every rank (rank 0 first); [] with the mp backend."""
        return self._actors.node_ids if self._actors else []

    @property
    def num_resident(self) -> int:
        return self.runner.num_resident

    def initialize(self) -> WorkerInfo:
        with self._lock:
            self._drain()
            self._sampled = []
            return self._on_group(("init", self.runner.max_num_batched_tokens), self.runner.initialize)

    def reset(self) -> None:
        with self._lock:
            self._drain()
            self._sampled = []
            self._on_group(("reset",), self.runner.reset)

    def validate(self, plan: StepPlan) -> None:
        self.runner.validate(plan)  # rank 0 alone: the followers hold the same state

    def execute(self, plan: StepPlan) -> StepResult:
        return self.submit(plan).result()

    def submit(self, plan: StepPlan) -> Future:
        """Broadcast `plan` and run this rank's part; the future gets the step's result (at once
        with one stage, when the last stage sends it back with several). Raises PlanError before
        anything changed for a plan that does not apply."""
        with self._lock:
            with self._sampled_lock:
                sampled, self._sampled = self._sampled, []
            self.runner.append_sampled(sampled)  # rank 0 is a follower with several stages
            try:
                if plan.draft_token_ids and any(not f.done() for f in self._inflight):
                    # the followers settle drafts from the result before the next plan: one plan at a time
                    raise PlanError("a plan with drafts while other steps are in flight")
                self.runner.validate(plan)  # before the broadcast: a bad plan changes no rank
            except BaseException:
                with self._sampled_lock:  # still the followers' (rank 0 appends each step once)
                    self._sampled = sampled + self._sampled
                raise
            future: Future = Future()
            if plan.draft_token_ids:
                self._drafting.add(plan.step_id)
            if self.pipeline_depth > 1:
                self._inflight = [f for f in self._inflight if not f.done()] + [future]
                self._expected.put((plan.step_id, future))
            try:
                local = self._on_group(("step", plan, sampled), lambda: self.runner.execute_validated(plan))
            except BaseException as error:
                if not future.done():  # the result thread may be gone already: nobody else would
                    future.set_exception(error)
                raise
            if self.pipeline_depth == 1:
                self._note_sampled(local)
                future.set_result(local)
            return future

    def close(self) -> None:
        """Stop the followers (a broadcast "stop"), wait for them, leave the group. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            if self._failure is None:
                self._drain()
            self._stopping = True
            if self._failure is None:
                try:
                    self._channel.send(("stop",))
                    self._channel.flush()
                except Exception as error:  # noqa: BLE001 - they are killed below anyway
                    log.warning("tp_stop_broadcast_failed", error=str(error))
            self._expected.put((None, None))  # the result thread ends
            for child in self._children:
                try:
                    child.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    child.kill()
            if self._actors is not None:
                self._actors.close(STOP_TIMEOUT_S)
            destroy_group()
        atexit.unregister(self.close)
        log.info("tp_group_stopped")

    # -- helpers --------------------------------------------------------------------------------

    def _note_sampled(self, result: StepResult) -> None:
        if result.token_ids:
            with self._sampled_lock:
                drafted = result.step_id in self._drafting
                self._drafting.discard(result.step_id)
                self._sampled.append((result.step_id, result.token_ids, result.request_ids if drafted else None))

    def _collect_results(self) -> None:
        """The last stage's results, in step order, to the futures `submit` returned. The tokens
        are noted before the future resolves: the scheduler can only plan a sequence's next step
        after it has this result, and by then its tokens go out with that plan."""
        while True:
            step_id, future = self._expected.get()
            if future is None:
                return
            try:
                result = self.stage.recv_result()
                if result.step_id != step_id:
                    raise TensorParallelError(f"the last stage reported step {result.step_id}, expected {step_id}")
            except Exception as error:  # noqa: BLE001 - a rank died: the group cannot go on
                self._fail(f"the last pipeline stage's result did not come: {error!r}")
                future.set_exception(TensorParallelError(str(self._failure)))
                self._fail_expected()
                return
            self._note_sampled(result)
            future.set_result(result)

    def _fail_expected(self) -> None:
        while True:
            try:
                _, future = self._expected.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                future.set_exception(TensorParallelError(str(self._failure)))

    def _drain(self) -> None:
        """Wait until every submitted step has reported (before init / reset / stop); a failed
        group reports nothing more (its futures have failed or will: nothing to wait for)."""
        if self._failure is None:
            wait_futures(self._inflight)
        self._inflight = []
        self._drafting.clear()

    def _heartbeat(self) -> None:
        """Both directions of liveness, every HEARTBEAT_S. Listen: a follower whose counter stood
        still (liveness.py; its node lost without a socket closing) fails the group now rather than
        at the next receive's timeout. Ping the ranks when no command went out for HEARTBEAT_S
        (tp_rank.Watchdog): a rank whose rank 0 vanished the same way then notices in seconds."""
        while not self._stopping and self._failure is None:
            time.sleep(HEARTBEAT_S)  # a poll interval
            if self._stopping or self._failure is not None:
                return  # closing: the followers stop beating on purpose
            try:
                silent = self._listener.silent()
            except Exception as error:  # noqa: BLE001 - our own store failing is a group failure too
                self._fail(f"the rendezvous store could not be read: {error!r}")
                return
            if silent:
                rank, seconds = next(iter(silent.items()))
                self._fail(f"rank {rank} sent no heartbeat for {seconds:.0f} s (its process, node or link is gone)")
                return
            if time.monotonic() - self._last_command < HEARTBEAT_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._stopping and self._failure is None:
                    self._channel.send(("ping",))
                    self._last_command = time.monotonic()
            except Exception as error:  # noqa: BLE001 - a rank died: the group fails
                self._fail(f"a heartbeat could not be sent: {error!r}")
            finally:
                self._lock.release()

    def _on_group(self, message: tuple, run_here):
        """Broadcast `message`, then run the same command on rank 0. Any error here is a group
        failure: the ranks may be stuck in different collectives, so the group cannot go on."""
        if self._failure is not None or self._stopping:
            raise TensorParallelError(f"the tensor-parallel group is down: {self._failure or 'closed'}")
        try:
            self._channel.send(message)
            self._last_command = time.monotonic()
            return run_here()
        except Exception as error:
            self._fail(f"{message[0]} failed on rank 0: {error!r}")
            raise TensorParallelError(str(self._failure)) from error

    def _spawn(self, rank: int, config: WorkerConfig) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                        os.environ.get("PYTHONPATH")]))}
        return subprocess.Popen(rank_argv(rank, self.placement, config), env=env, cwd=REPO)

    def _watch(self, child: subprocess.Popen) -> None:
        code = child.wait()
        if not self._stopping:
            self._fail(f"tensor-parallel rank process {child.pid} exited with {code}")

    def _fail(self, reason: str) -> None:
        # One failure at a time: a dead rank is often noticed by two threads at once (the step's
        # send and the result thread's receive), and the second one's exit must not cut off the
        # first one's log line (the only record of why the worker restarted).
        with self._fail_lock:
            if self._failure is None:
                self._failure = reason
                log.error("tp_group_failed", reason=reason, exit_on_failure=self._exit_on_failure)
            self._kill_children()  # a blocked collective on rank 0 then errors out too
            if self._exit_on_failure:
                for stream in (sys.stdout, sys.stderr):  # os._exit skips the buffers
                    stream.flush()
                os._exit(1)  # noqa: SLF001 - the process is the worker: its supervisor restarts it

    def _kill_children(self) -> None:
        for child in self._children:
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
        if self._actors is not None:
            self._actors.kill()
