"""Brownout: under sustained memory pressure, serve shorter answers instead of thrashing the pool.

Pressure is read once per step from two signals the core already keeps, with steps as the clock
(the caller feeds one observation per step, so tests drive it with plain numbers):
- KV usage (used blocks / total) at or above `kv_watermark` for `window_steps` steps in a row;
- `preemption_threshold` or more preemptions within the last `window_steps` steps.
Either one enters brownout. While in it the scheduler (its BrownoutGovernor) plans steps with the smaller
`max_num_batched_tokens` and caps the max_tokens of each request it admits for the *first* time to
`max_tokens`. Requests already admitted (running, or preempted and waiting to resume) keep the
limit they were accepted with: their callers may already be streaming them.
It leaves with hysteresis: after `window_steps` steps in a row with KV usage below
`kv_recover_watermark` and no preemption; or at once when the engine has nothing left to run.

Pure and O(1) per step: no torch, no grpc, no clock; transitions are returned to the caller, which
logs them, puts them on the step span and exposes the gauge (scheduler_svc/engine_loop.py).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from scheduler_svc.core.request import Request


@dataclass(frozen=True, slots=True)
class BrownoutConfig:
    max_tokens: int = 256  # cap on a newly admitted request's max_tokens while in brownout
    # the step token budget while in brownout; None: half of max_num_batched_tokens, at least
    # max_num_seqs (below that, running decodes would take turns)
    max_num_batched_tokens: int | None = None
    kv_watermark: float = 0.95  # enter: KV usage >= this for window_steps steps in a row (> 1: off)
    kv_recover_watermark: float = 0.80  # leave: usage below this (and no preemption) for window_steps
    preemption_threshold: int = 4  # enter: this many preemptions within window_steps (0: off)
    window_steps: int = 32

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("brownout max_tokens must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("brownout max_num_batched_tokens must be at least 1")
        if not 0.0 < self.kv_recover_watermark <= self.kv_watermark:
            raise ValueError("need 0 < brownout kv_recover_watermark <= kv_watermark")
        if self.preemption_threshold < 0 or self.window_steps < 1:
            raise ValueError("need brownout preemption_threshold >= 0 and window_steps >= 1")

    def step_budget(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(max_num_batched_tokens // 2, min(max_num_seqs, max_num_batched_tokens))


@dataclass(frozen=True, slots=True)
class BrownoutChange:
    """One transition, for the log, the step span and tests."""

    active: bool  # True: entered; False: left
    step: int  # the observation (step) count at which it happened
    reason: str  # "kv_usage" | "preemptions" | "recovered" | "idle"
    kv_usage: float
    preemptions_in_window: int


class Brownout:
    """The decision: feed `observe()` once per step; it answers a BrownoutChange or None."""

    __slots__ = ("config", "active", "steps", "_high", "_calm", "_seen", "_recent", "_in_window")

    def __init__(self, config: BrownoutConfig) -> None:
        self.config = config
        self.active = False
        self.steps = 0  # observations so far: the clock
        self._high = 0  # consecutive steps with KV usage >= kv_watermark
        self._calm = 0  # consecutive steps below kv_recover_watermark without a preemption
        self._seen = 0  # the preemption total at the last observation
        self._recent: deque[tuple[int, int]] = deque()  # (step, preemptions) in the window, if > 0
        self._in_window = 0  # their sum

    def rebase(self, preemptions_total: int) -> None:
        """Preemptions that are not pressure (a worker loss preempts everything) are not counted."""
        self._seen = preemptions_total

    def observe(self, kv_usage: float, preemptions_total: int) -> BrownoutChange | None:
        cfg = self.config
        self.steps += 1
        new = preemptions_total - self._seen
        self._seen = preemptions_total
        recent = self._recent
        if new:
            recent.append((self.steps, new))
            self._in_window += new
        while recent and recent[0][0] <= self.steps - cfg.window_steps:
            self._in_window -= recent.popleft()[1]
        self._high = self._high + 1 if kv_usage >= cfg.kv_watermark else 0
        if not self.active:
            if self._high >= cfg.window_steps:
                return self._change(True, "kv_usage", kv_usage)
            if cfg.preemption_threshold and self._in_window >= cfg.preemption_threshold:
                return self._change(True, "preemptions", kv_usage)
            return None
        self._calm = self._calm + 1 if kv_usage < cfg.kv_recover_watermark and not new else 0
        if self._calm >= cfg.window_steps:
            return self._change(False, "recovered", kv_usage)
        return None

    def leave_idle(self) -> BrownoutChange | None:
        """Nothing left to run: no pressure (and no more observations to recover with)."""
        return self._change(False, "idle", 0.0) if self.active else None

    def _change(self, active: bool, reason: str, kv_usage: float) -> BrownoutChange:
        self.active = active
        self._high = self._calm = 0
        return BrownoutChange(active, self.steps, reason, kv_usage, self._in_window)


class BrownoutGovernor:
    """The Scheduler's side: one `observe()` per schedule() while enabled, the cap at first admission.

    `changes` holds the transitions not yet taken by the engine loop (bounded: transitions are
    rare, and the offline LLM never takes them).
    """

    def __init__(self, config: BrownoutConfig | None, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.config = config
        self.decider = Brownout(config) if config is not None else None
        self.enabled = config is not None
        self._max_num_batched_tokens = max_num_batched_tokens
        self._max_num_seqs = max_num_seqs
        self.step_budget = max_num_batched_tokens  # the token budget of the next step
        self.cap = 0  # the max_tokens cap of a newly admitted request; 0: no cap
        self.changes: deque[BrownoutChange] = deque(maxlen=16)
        self.entries = 0
        self.capped_requests = 0

    @property
    def active(self) -> bool:
        return self.decider is not None and self.decider.active

    def observe(self, kv_usage: float, preemptions_total: int) -> None:
        """One step's observation (only while enabled)."""
        change = self.decider.observe(kv_usage, preemptions_total)  # type: ignore[union-attr]
        if change is not None:
            self.apply(change)

    def leave_idle(self) -> None:
        if self.decider is not None and (change := self.decider.leave_idle()) is not None:
            self.apply(change)

    def rebase(self, preemptions_total: int) -> None:
        if self.decider is not None:
            self.decider.rebase(preemptions_total)

    def apply(self, change: BrownoutChange) -> None:
        if change.active:
            cfg = self.config
            assert cfg is not None  # a change comes only from the decider, which needs a config
            self.step_budget = cfg.step_budget(self._max_num_batched_tokens, self._max_num_seqs)
            self.cap = cfg.max_tokens
            self.entries += 1
        else:
            self.step_budget = self._max_num_batched_tokens
            self.cap = 0
        self.changes.append(change)

    def cap_max_tokens(self, req: Request) -> None:
        """At a request's first admission in brownout: lower its max_tokens to the cap (never below
        its min_tokens). The worker is sent the capped SamplingParams, so both sides agree."""
        cap = max(self.cap, req.sampling.min_tokens)
        if req.max_tokens > cap:
            req.max_tokens = cap
            req.max_num_tokens = req.num_prompt_tokens + cap
            req.sampling = dataclasses.replace(req.sampling, max_tokens=cap)
            self.capped_requests += 1
