"""Rank 0 of a tensor-parallel worker group: spawns the other ranks and drives them.

    scheduler --gRPC--> rank 0 (WorkerServicer + TPDriver) --broadcast--> ranks 1..N-1 (tp_rank.py)

The driver is a StepRunner (worker_svc/service.py): the servicer (or the offline LLM) calls it as
it would a ModelRunner. Each command (init, reset, step, stop) is broadcast once, then every rank
runs it; only rank 0 samples, and the tokens it sampled ride on the next step's message.

Failure: a rank that dies (its process exits, or a collective raises) leaves the group unusable.
A server (exit_on_failure=True) then kills the other ranks and exits non-zero, so the launcher /
compose restarts it and the scheduler's reconnect path resyncs; the offline LLM gets a
TensorParallelError instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from pagoda.contract.step import StepPlan, StepResult, WorkerInfo
from pagoda.runtime.logging import get_logger
from worker_svc.config import WorkerConfig
from worker_svc.distributed import (
    ControlChannel,
    TensorParallelError,
    check_divisible,
    destroy_group,
    free_port,
    init_group,
)
from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.model_runner import ModelRunner, resolve_device

log = get_logger(__name__)
REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 10.0


def create_runner(config: WorkerConfig, max_num_batched_tokens: int = 8192,
                  exit_on_failure: bool = False) -> ModelRunner | TPDriver:
    """A plain ModelRunner for tensor_parallel_size 1 (no collectives at all), else a TP group."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, max_num_batched_tokens)
    return TPDriver(config, max_num_batched_tokens, exit_on_failure)


def cpu_threads_per_rank(size: int) -> int:
    """CPU ranks share the machine's cores instead of each grabbing all of them."""
    return max(1, (os.cpu_count() or 1) // size)


class TPDriver:
    def __init__(self, config: WorkerConfig, max_num_batched_tokens: int,
                 exit_on_failure: bool) -> None:
        model_config = ModelConfig.from_dir(config.model)
        size = config.tensor_parallel_size
        check_divisible(model_config.num_heads, model_config.num_kv_heads,
                        model_config.intermediate_size, size, model_config.moe_intermediate_size)
        self._exit_on_failure = exit_on_failure
        self._lock = threading.Lock()  # one command at a time on the control group
        self._stopping = False
        self._failure: str | None = None
        self._pending_tokens: list[int] = []  # sampled last step, not yet sent to the followers
        device = resolve_device(config.device, 0, size)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(size))
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._children = [self._spawn(rank, size, init_method, config) for rank in range(1, size)]
        for child in self._children:
            threading.Thread(target=self._watch, args=(child,), daemon=True,
                             name=f"tp-watch-{child.pid}").start()
        try:
            self.tp = init_group(0, size, init_method, device)
            self._channel = ControlChannel(self.tp)
            self.runner = ModelRunner(config, max_num_batched_tokens, self.tp)
        except BaseException:
            self._kill_children()
            destroy_group()
            raise
        atexit.register(self.close)
        log.info("tp_group_ready", tensor_parallel_size=size, device=str(self.runner.device),
                 pids=[c.pid for c in self._children])

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
    def num_resident(self) -> int:
        return self.runner.num_resident

    def initialize(self) -> WorkerInfo:
        with self._lock:
            self._pending_tokens = []
            return self._on_group(("init", self.runner.max_num_batched_tokens), self.runner.initialize)

    def reset(self) -> None:
        with self._lock:
            self._pending_tokens = []
            self._on_group(("reset",), self.runner.reset)

    def validate(self, plan: StepPlan) -> None:
        self.runner.validate(plan)  # rank 0 alone: the followers hold the same state

    def execute(self, plan: StepPlan) -> StepResult:
        with self._lock:
            self.runner.validate(plan)  # before the broadcast: a bad plan changes no rank
            result = self._on_group(("step", plan, self._pending_tokens),
                                    lambda: self.runner.execute_validated(plan))
            self._pending_tokens = result.token_ids
            return result

    def close(self) -> None:
        """Stop the followers (a broadcast "stop"), wait for them, leave the group. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            if self._failure is None:
                try:
                    self._channel.send(("stop",))
                except Exception as error:  # noqa: BLE001 - they are killed below anyway
                    log.warning("tp_stop_broadcast_failed", error=str(error))
            for child in self._children:
                try:
                    child.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    child.kill()
            destroy_group()
        atexit.unregister(self.close)
        log.info("tp_group_stopped")

    # -- helpers --------------------------------------------------------------------------------

    def _on_group(self, message: tuple, run_here):
        """Broadcast `message`, then run the same command on rank 0. Any error here is a group
        failure: the ranks may be stuck in different collectives, so the group cannot go on."""
        if self._failure is not None or self._stopping:
            raise TensorParallelError(f"the tensor-parallel group is down: {self._failure or 'closed'}")
        try:
            self._channel.send(message)
            return run_here()
        except Exception as error:
            self._fail(f"{message[0]} failed on rank 0: {error!r}")
            raise TensorParallelError(str(self._failure)) from error

    def _spawn(self, rank: int, size: int, init_method: str, config: WorkerConfig) -> subprocess.Popen:
        argv = [sys.executable, "-m", "worker_svc.tp_rank", "--rank", str(rank), "--world-size",
                str(size), "--init-method", init_method,
                "--config", json.dumps(dataclasses.asdict(config))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                        os.environ.get("PYTHONPATH")]))}
        return subprocess.Popen(argv, env=env, cwd=REPO)

    def _watch(self, child: subprocess.Popen) -> None:
        code = child.wait()
        if not self._stopping:
            self._fail(f"tensor-parallel rank process {child.pid} exited with {code}")

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            log.error("tp_group_failed", reason=reason, exit_on_failure=self._exit_on_failure)
        self._kill_children()  # a blocked collective on rank 0 then errors out too
        if self._exit_on_failure:
            os._exit(1)  # noqa: SLF001 - the process is the worker: its supervisor restarts it

    def _kill_children(self) -> None:
        for child in self._children:
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
