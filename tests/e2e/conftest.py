"""Real-process fixtures for end-to-end tests: worker and scheduler as separate processes on loopback.

Reusable pieces (the gateway's e2e tests build on them):
- `tiny_model_dir` (session): `models/pagoda-tiny` when `make model` made it, else generated once
  into a session tmp dir with `python -m pagoda.tools.tiny_model --out ...`.
- `ServiceProcess`: one `python -m ...` child with its log file; `wait_serving()` polls
  grpc.health.v1 with a deadline (failing fast, with the log tail, if the process exits);
  `stop()` sends SIGTERM, waits, then kills.
- `start_worker(model, **flags)` / `start_scheduler(worker_target, **flags)`: start one on a free
  port and wait until it is SERVING (a worker is SERVING only after Init, so start_worker waits for
  the port to answer health and start_scheduler waits for the worker's Init + the engine loop).
- `engine_processes` (session): a tiny-model worker + scheduler, shared by every e2e test;
  `.scheduler_target` / `.worker_target` are "127.0.0.1:PORT".
- `gateway_stack` (session, from gateway_conftest.py): one gateway on top of it, for every module.
Flags are keyword arguments with underscores: `start_scheduler(t, max_num_seqs=8, no_pipelining=True)`
(True -> a bare flag).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.entrypoints.launcher.supervisor import stop_process

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "pagoda-tiny"
STARTUP_DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flag_args(flags: dict) -> list[str]:
    args: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not None and value is not False:
            args += [flag, str(value)]
    return args


def health_status(target: str, timeout_s: float = 1.0) -> int | None:
    with grpc.insecure_channel(target) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s).status
        except grpc.RpcError:
            return None


class ServiceProcess:
    def __init__(self, name: str, module: str, args: list[str], port: int, log_dir: Path) -> None:
        self.name, self.port = name, port
        self.target = f"127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}-{port}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_until(self, predicate, what: str, deadline_s: float = STARTUP_DEADLINE_S) -> None:
        end = time.monotonic() + deadline_s
        while not predicate():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before {what}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > end:
                self.proc.kill()  # never came up: no fixture holds it to stop it later
                self.proc.wait()
                raise TimeoutError(f"{self.name} not {what} after {deadline_s}s:\n{self.log_tail()}")
            time.sleep(0.05)  # poll interval; the deadline bounds the wait

    def wait_serving(self, deadline_s: float = STARTUP_DEADLINE_S) -> None:
        self.wait_until(lambda: health_status(self.target) == health_pb2.HealthCheckResponse.SERVING,
                        "SERVING", deadline_s)

    def wait_answering(self, deadline_s: float = STARTUP_DEADLINE_S) -> None:
        """The gRPC server is up (health answers, SERVING or not)."""
        self.wait_until(lambda: health_status(self.target) is not None, "answering", deadline_s)

    def stop(self, timeout_s: float = 10.0) -> int:
        return stop_process(self.proc, timeout_s)


def start_worker(model: Path | None, log_dir: Path, **flags) -> ServiceProcess:
    port = free_port()
    args = ["--port", str(port), *(["--model", str(model)] if model else []), *flag_args(flags)]
    worker = ServiceProcess("worker", "worker_svc", args, port, log_dir)
    worker.wait_answering()
    return worker


def start_scheduler(worker_target: str, log_dir: Path, **flags) -> ServiceProcess:
    port = free_port()
    args = ["--port", str(port), "--workers", worker_target, *flag_args(flags)]
    scheduler = ServiceProcess("scheduler", "scheduler_svc", args, port, log_dir)
    scheduler.wait_serving()
    return scheduler


@dataclass
class EngineProcesses:
    worker: ServiceProcess
    scheduler: ServiceProcess
    model_dir: Path

    @property
    def scheduler_target(self) -> str:
        return self.scheduler.target

    @property
    def worker_target(self) -> str:
        return self.worker.target

    def stop(self) -> None:
        self.scheduler.stop()
        self.worker.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    if (DEFAULT_MODEL / "model.safetensors").exists():
        return DEFAULT_MODEL
    out = tmp_path_factory.mktemp("model") / "pagoda-tiny"
    subprocess.run([sys.executable, "-m", "pagoda.tools.tiny_model", "--out", str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    return out


# The worker flags of the shared engine, so tests can build an identical offline LLM.
ENGINE_WORKER_FLAGS = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 512}
ENGINE_SCHEDULER_FLAGS = {"max_num_seqs": 32, "max_num_batched_tokens": 512}


@pytest.fixture(scope="session")
def engine_processes(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    worker = start_worker(tiny_model_dir, logs, **ENGINE_WORKER_FLAGS)
    try:
        scheduler = start_scheduler(worker.target, logs, **ENGINE_SCHEDULER_FLAGS)
    except BaseException:
        worker.stop()
        raise
    engine = EngineProcesses(worker, scheduler, tiny_model_dir)
    yield engine
    engine.stop()


# Registered here, once: a fixture imported into several test modules is one instance per module.
from tests.e2e.gateway_conftest import gateway_stack  # noqa: E402,F401 - needs the names above
from tests.e2e.smollm2_api import smollm2_api  # noqa: E402,F401 - the issue-23 API tests' stack
