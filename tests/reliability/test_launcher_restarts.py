"""The launcher's supervisor restarts every dead child, even while another restarted child is not
ready yet.

A rolling restart stops a replica's scheduler (it drains and exits) and then its worker. The
supervisor used to restart the scheduler and then wait, in its loop, for it to serve, which it
cannot do without its worker, which the loop never reached: the replica stayed down for the whole
startup timeout (found by benchmarks.soak's `drain` fault on `make run DP=2`). Here the children are
plain sleeping interpreters whose health port nothing answers, so the "scheduler" never becomes
ready; the "worker" must be restarted all the same.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pagoda.entrypoints.launcher.supervisor import Child, supervise
from tests.e2e.conftest import free_port

pytestmark = pytest.mark.timeout(60)
SLEEPER = ["timeit", "-n", "1", "-r", "1", "import time; time.sleep(120)"]  # python -m timeit ...


def _replaced(child: Child, old_pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if child.proc.pid != old_pid and child.alive():
            return True
        time.sleep(0.05)  # poll interval; bounded by within_s
    return False


def test_a_child_not_ready_after_its_restart_does_not_hold_up_the_next_restart():
    worker = Child("worker", SLEEPER, f"127.0.0.1:{free_port()}", needs_serving=False)
    scheduler = Child("scheduler", SLEEPER, f"127.0.0.1:{free_port()}", needs_serving=True)
    children, stop = [worker, scheduler], threading.Event()
    for child in children:
        child.start()
    loop = threading.Thread(target=supervise, args=(children, stop, 60.0))  # 60 s: the old wait
    loop.start()
    try:
        first = scheduler.proc.pid
        os.kill(first, signal.SIGTERM)  # drained and gone
        assert _replaced(scheduler, first, 10.0), "the scheduler was not restarted"
        old_worker = worker.proc.pid
        os.kill(old_worker, signal.SIGTERM)  # then its worker, while the new scheduler is not ready
        assert _replaced(worker, old_worker, 10.0), "the worker was not restarted within 10 s"
    finally:
        stop.set()
        loop.join(10)
        for child in children:
            child.stop(timeout_s=5.0)
    assert not loop.is_alive()
