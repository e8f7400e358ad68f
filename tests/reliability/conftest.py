"""Real-process stacks for the fault tests, on top of `tests/e2e/conftest.py`'s ServiceProcess.

`start_stack(log_dir, ...)` starts worker (fake unless a model is given) -> scheduler -> gateway on
free loopback ports and returns a `Stack`; `restart_worker` / `restart_scheduler` start a fresh
process on the same port, as the launcher (or compose's `restart: unless-stopped`) would.
The fake worker answers at once, so fault tests whose outcome does not depend on the model stay fast.

Starting a stack costs seconds of the 2-core budget, so tests that leave their processes alive
share one per flag set, for the whole session:
- `fake_stack`: context 128 (cheap schemathesis requests), 64 KiB request bodies: bad input, the
  soak, cache-salt isolation, loopback binds (and a second gateway with an API key on top of it);
- `small_queue_stack`: 4 running + 4 waiting requests, the worker's full context: overload, and
  requests that must stay resident longer than 128 tokens.
Tests that kill, restart or SIGTERM a process, or need other flags (TLS), start their own.
Every test that uses a shared stack leaves it idle, with no block in use.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from pagoda.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.conftest import (
    DEFAULT_MODEL,
    ServiceProcess,
    flag_args,
    free_port,
    tiny_model_dir,  # noqa: F401 - a fixture for this package
)
from tests.e2e.gateway_conftest import start_gateway
from worker_svc.fake.runner import fake_vocab_size

# Also the tokenizer of the fake worker's gateway; the fake worker reports its vocabulary.
TOKENIZER_DIR = DEFAULT_MODEL
FAKE_VOCAB_SIZE = fake_vocab_size(TOKENIZER_DIR)
SHARED_MAX_MODEL_LEN = 128
SHARED_MAX_REQUEST_BYTES = 64 * 1024
SMALL_QUEUE_MAX_NUM_SEQS, SMALL_QUEUE_MAX_WAITING = 4, 4


def worker_process(log_dir: Path, port: int, model: Path | None = None, **flags) -> ServiceProcess:
    if model is None:
        flags = {"vocab_size": FAKE_VOCAB_SIZE, **flags}
    args = ["--port", str(port), *(["--model", str(model)] if model else ["--fake"]), *flag_args(flags)]
    worker = ServiceProcess("worker", "worker_svc", args, port, log_dir)
    worker.wait_answering()
    return worker


def scheduler_process(worker_target: str, log_dir: Path, port: int, **flags) -> ServiceProcess:
    args = ["--port", str(port), "--workers", worker_target, *flag_args(flags)]
    return ServiceProcess("scheduler", "scheduler_svc", args, port, log_dir)


@dataclass
class Stack:
    log_dir: Path
    worker: ServiceProcess
    scheduler: ServiceProcess
    gateway: ServiceProcess | None = None
    http_url: str = ""
    model: Path | None = None
    worker_flags: dict = field(default_factory=dict)
    scheduler_flags: dict = field(default_factory=dict)

    def restart_worker(self) -> None:
        self.worker = worker_process(self.log_dir, self.worker.port, self.model, **self.worker_flags)

    def restart_scheduler(self) -> None:
        self.scheduler = scheduler_process(self.worker.target, self.log_dir, self.scheduler.port,
                                           **self.scheduler_flags)
        self.scheduler.wait_serving()

    def kill_worker(self) -> None:
        os.kill(self.worker.proc.pid, signal.SIGKILL)
        self.worker.proc.wait(10)

    def stats(self) -> engine_pb2.EngineStats:
        with grpc.insecure_channel(self.scheduler.target) as channel:
            return engine_pb2_grpc.EngineStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=5)

    def wait_idle(self, deadline_s: float = 20.0) -> engine_pb2.EngineStats:
        """Stats once the engine is idle and the worker holds nothing: a stream's last chunk can
        reach the client a step before the scheduler retires the request from the worker."""
        end = time.monotonic() + deadline_s
        while not ((stats := self.stats()).idle and stats.worker_resident_requests == 0):
            assert time.monotonic() < end, f"engine not idle after {deadline_s}s: {stats}"
            time.sleep(0.02)  # poll interval; the deadline bounds the wait
        return stats

    def stop(self) -> None:
        for process in (self.gateway, self.scheduler, self.worker):
            if process is not None:
                process.stop()


def start_stack(log_dir: Path, *, model: Path | None = None, gateway: bool = True,
                gateway_args: tuple[str, ...] = (), worker_flags: dict | None = None,
                scheduler_flags: dict | None = None) -> Stack:
    worker_flags = {"num_gpu_blocks_override": 512, **(worker_flags or {})}
    scheduler_flags = dict(scheduler_flags or {})
    worker = worker_process(log_dir, free_port(), model, **worker_flags)
    scheduler = scheduler_process(worker.target, log_dir, free_port(), **scheduler_flags)
    stack = Stack(log_dir, worker, scheduler, model=model, worker_flags=worker_flags,
                  scheduler_flags=scheduler_flags)
    try:
        scheduler.wait_serving()
        if gateway:
            tokenizer = () if model else ("--tokenizer", str(TOKENIZER_DIR))
            stack.gateway, stack.http_url = start_gateway(scheduler.target, log_dir, *tokenizer,
                                                          *gateway_args)
    except BaseException:
        stack.stop()
        raise
    return stack


def completion(http_url: str, prompt="The river", timeout_s: float = 30.0, headers=None,
               **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(f"{http_url}/v1/completions", json=body, timeout=timeout_s, headers=headers)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="session")
def fake_stack(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("fake-stack"),
                        worker_flags={"max_model_len": SHARED_MAX_MODEL_LEN},
                        gateway_args=("--max-request-bytes", str(SHARED_MAX_REQUEST_BYTES)))
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def small_queue_stack(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("small-queue"),
                        scheduler_flags={"max_num_seqs": SMALL_QUEUE_MAX_NUM_SEQS,
                                         "max_waiting_requests": SMALL_QUEUE_MAX_WAITING})
    yield stack
    stack.stop()
