"""One supervised child process: start it in a session of its own, probe its health, restart it
when it dies (a bounded number of times), stop it and everything it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.runtime.healthcheck import check_serving
from pagoda.runtime.shutdown import EXIT_MARGIN_S, LAUNCHER_PID_ENV

REPO = Path(__file__).resolve().parents[3]
MAX_RESTARTS = 5  # per child within RESTART_WINDOW_S; beyond that the launcher gives up
RESTART_WINDOW_S = 60.0
# Beyond --shutdown-timeout. A child's own exit watchdog fires at EXIT_MARGIN_S (it dumps its
# stacks and exits 1); the launcher's SIGKILL comes after that, as the last resort.
STOP_MARGIN_S = EXIT_MARGIN_S + 5.0
GROUP_EXIT_S = 5.0  # what a child started itself gets this long to follow it, then SIGKILL


def say(message: str) -> None:
    """A launcher line on stderr; never raises (a closed terminal must not abort the stop)."""
    try:
        print(f"[launcher] {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def stop_process(proc: subprocess.Popen, timeout_s: float, hurry: threading.Event | None = None) -> int:
    """SIGTERM (the services drain on it), then SIGKILL if it has not exited within timeout_s, or
    as soon as `hurry` is set. Returns the exit code (negative: the signal that ended it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < end and not (hurry and hurry.is_set()):
            try:
                proc.wait(min(0.2, max(end - time.monotonic(), 0.0)))  # bounded: re-checks hurry
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`, from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # fields after "(comm)": state, ppid, pgrp, ...
            state, _ppid, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # exited meanwhile
            continue
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def reap_group(pgid: int, timeout_s: float = GROUP_EXIT_S) -> list[int]:
    """After a group leader exited: wait for the rest of its group (the processes it started,
    e.g. tensor-parallel ranks), SIGKILL what is still there. Returns the pids that had to be
    killed. A group id stays reserved while any member lives, so this never hits a stranger."""
    if not Path("/proc").is_dir():
        return []
    end = time.monotonic() + timeout_s
    while (left := group_members(pgid)) and time.monotonic() < end:
        time.sleep(0.05)  # poll interval; bounded by timeout_s
    if left:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return []
        end = time.monotonic() + 2.0
        while group_members(pgid) and time.monotonic() < end:
            time.sleep(0.05)  # SIGKILL is not instant either
    return left


@dataclass
class Child:
    name: str
    argv: list[str]
    health_target: str
    needs_serving: bool  # False: "answers health" is enough (a worker is NOT_SERVING until Init)
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment

    def start(self) -> None:
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which then stops
        # the children in order (all at once, the worker would die under a draining scheduler).
        # Its process group then holds what it starts itself, for `reap_group`. No preexec_fn:
        # subprocess would fork() rather than vfork(), and gRPC's fork handlers can hang that.
        self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], cwd=REPO, start_new_session=True,
                                     env={**os.environ, **self.env, LAUNCHER_PID_ENV: str(os.getpid())})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        if not self.health_target:  # no server (another node's ranks): running is ready
            return self.alive()
        serving, status = check_serving(self.health_target, timeout_s=1.0)
        if self.needs_serving:
            return serving
        return serving or status == "NOT_SERVING"

    def stop(self, timeout_s: float = 10.0, hurry: threading.Event | None = None) -> None:
        """Stop it and everything it started; says how each ended."""
        if self.proc is None:
            return
        started = time.monotonic()
        was_running = self.proc.poll() is None
        code = stop_process(self.proc, timeout_s, hurry)
        how = f"exited ({code})" if code != -signal.SIGKILL else "killed (SIGKILL)"
        if was_running:
            say(f"{self.name} {how} after {time.monotonic() - started:.1f}s")
        if stragglers := reap_group(self.proc.pid):
            say(f"{self.name}: killed {len(stragglers)} process(es) it left behind: {stragglers}")


def wait_ready(child: Child, stop: threading.Event, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while not stop.is_set():
        if not child.alive():
            print(f"[launcher] {child.name} exited with {child.proc.returncode}", file=sys.stderr)
            return False
        if child.ready():
            return True
        if time.monotonic() > end:
            print(f"[launcher] {child.name} not ready after {deadline_s:.0f}s", file=sys.stderr)
            return False
        stop.wait(0.2)  # poll interval, bounded by the deadline
    return False


def supervise(children: list[Child], stop: threading.Event, deadline_s: float) -> int:
    """Restart dead children until stopped; 1 if one keeps dying.

    A restarted child's readiness is awaited on a thread of its own, never by this loop: a
    scheduler restarted after a drain waits for its worker, and if that worker is being restarted
    too (a rolling restart stops both) the loop must get to it. Waiting here once held a rolling
    restart for the whole startup timeout (benchmarks.soak's `drain` fault)."""
    while not stop.wait(0.5):
        for child in children:
            if child.alive():
                continue
            now = time.monotonic()
            child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(child.restarts) > MAX_RESTARTS:
                print(f"[launcher] {child.name} died {MAX_RESTARTS} times in {RESTART_WINDOW_S:.0f}s; "
                      "giving up", file=sys.stderr)
                return 1
            print(f"[launcher] {child.name} died ({child.proc.returncode}); restarting", file=sys.stderr)
            child.start()
            threading.Thread(target=_say_when_ready, args=(child, child.proc, stop, deadline_s),
                             name=f"ready-{child.name}", daemon=True).start()
    return 0


def _say_when_ready(child: Child, proc: subprocess.Popen, stop: threading.Event, deadline_s: float) -> None:
    if wait_ready(child, stop, deadline_s) and child.proc is proc:  # not restarted again meanwhile
        say(f"{child.name} ready again")
