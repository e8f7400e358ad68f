"""Where the worker runs its runner: on the event loop's thread on CPU (a helper thread there cost
~10% of served throughput on a 2-core machine), on one helper thread on a GPU (the loop decodes the
next plan while the device computes). Either way one thread only."""

from __future__ import annotations

import threading

import torch

from worker_svc.service import WorkerServicer


class _Runner:
    def __init__(self, device: str | None) -> None:
        if device is not None:
            self.device = torch.device(device)
        self.threads: set[int] = set()

    def work(self) -> None:
        self.threads.add(threading.get_ident())


async def _threads_used(device: str | None) -> set[int]:
    runner = _Runner(device)
    servicer = WorkerServicer(runner, health=None)
    try:
        for _ in range(3):
            await servicer._on_runner_thread(runner.work)
    finally:
        servicer.close()
    return runner.threads


async def test_cpu_and_fake_runners_run_on_the_loop_thread():
    assert await _threads_used("cpu") == {threading.get_ident()}
    assert await _threads_used(None) == {threading.get_ident()}


async def test_a_gpu_runner_runs_on_one_helper_thread():
    used = await _threads_used("cuda")  # no CUDA needed: only the device's type is read
    assert len(used) == 1 and threading.get_ident() not in used
