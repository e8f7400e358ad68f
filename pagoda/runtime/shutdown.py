"""Every service's stop path ends its process, on every branch.

A stop signal (SIGINT / SIGTERM) sets the service's `stop` event and arms an exit watchdog: if
the process is still alive `bound_s` later, faulthandler's own C thread — it needs neither the
GIL nor the event loop — writes every thread's stack to stderr and `_exit(1)`s. That covers what
a graceful stop cannot time out itself: a server stop that never completes, a task that keeps the
loop alive, a non-daemon thread or an atexit handler holding the interpreter's exit. The stacks
in the log say where it hung; the non-zero exit tells the supervisor it did.

A second signal while stopping means "now" (an operator pressing Ctrl-C twice, a supervisor's
second SIGTERM): the watchdog is re-armed to fire at once, skipping what is left of the drain.

A service started by the launcher (which sets PAGODA_LAUNCHER_PID) also stops when the launcher
dies, however it dies (Linux PR_SET_PDEATHSIG: SIGTERM, then the same graceful stop). It is set
here, in the child, rather than with a preexec_fn in the launcher: that would make subprocess
fork() instead of vfork(), and gRPC's fork handlers in a process with live channels can hang it.
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import os
import signal
import sys

from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Beyond a service's drain: the servers' grace periods, the channels' close, the tracing flush
# (bounded at 5 s), a tensor-parallel group's stop, the interpreter's exit. The launcher waits a
# little longer before its SIGKILL, so a hung child dumps its stacks first.
EXIT_MARGIN_S = 15.0
FORCED_EXIT_S = 0.5  # a second signal: time to write the stacks, then exit
LAUNCHER_PID_ENV = "PAGODA_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def arm_exit_watchdog(bound_s: float) -> None:
    """Dump every thread's stack and `_exit(1)` unless the process ends within `bound_s`.
    Re-arming replaces the previous deadline."""
    faulthandler.dump_traceback_later(bound_s, repeat=False, file=sys.stderr, exit=True)


def install_stop_handlers(stop: asyncio.Event, bound_s: float, service: str) -> None:
    """SIGINT/SIGTERM set `stop` and arm the exit watchdog at `bound_s`; a second one forces the
    exit. Call from the running loop that awaits `stop`."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("forced_exit", service=service, signal=name, exit_in_s=FORCED_EXIT_S)
            arm_exit_watchdog(FORCED_EXIT_S)
            return
        log.info("stop_signal_received", service=service, signal=name, exit_bound_s=bound_s)
        arm_exit_watchdog(bound_s)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    stop_with_launcher(service)


def stop_with_launcher(service: str) -> None:
    """When started by the launcher: SIGTERM when it dies, and SIGTERM now if it already has. The
    variable is removed, so what this process starts itself does not inherit it."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # no prctl: the launcher's own stop still applies
        return
    if os.getppid() != int(launcher):  # it died before prctl: no signal would ever come
        log.warning("launcher_gone", service=service, launcher_pid=int(launcher))
        os.kill(os.getpid(), signal.SIGTERM)
