"""Per-tenant admission: token buckets for requests/min and tokens/min, and a concurrency cap. Pure:
every method takes `now` (seconds, any monotonic clock), so tests drive time by hand.

A bucket holds up to one minute's allowance (`capacity`) and refills continuously at
capacity / 60 per second. A request takes 1 from the request bucket and its reservation
(prompt tokens + n × max_tokens) from the token bucket, both or neither; when it ends, the part of
the reservation it did not use goes back (`finish`). Usage above the reservation is charged too, so
a bucket may go below zero (a debt the refill pays off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.tenancy.tenants import TenantLimits

PERIOD_S = 60.0


class TokenBucket:
    __slots__ = ("capacity", "rate", "level", "updated")

    def __init__(self, capacity: int, now: float, period_s: float = PERIOD_S) -> None:
        self.capacity = capacity
        self.rate = capacity / period_s  # units per second
        self.level = float(capacity)
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: now)."""
        self._refill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def snapshot(self, now: float) -> LimitSnapshot:
        self._refill(now)
        return LimitSnapshot(self.capacity, max(0, math.floor(self.level)),
                             (self.capacity - self.level) / self.rate)


@dataclass(frozen=True, slots=True)
class LimitSnapshot:
    """What OpenAI's x-ratelimit-{limit,remaining,reset}-* headers say about one bucket."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    refused_by: str | None = None  # "requests" | "tokens" | "concurrency"
    retry_after_s: float = 0.0
    requests: LimitSnapshot | None = None  # None: no such limit
    tokens: LimitSnapshot | None = None


class TenantLimiter:
    """One tenant's buckets and in-flight count."""

    def __init__(self, limits: TenantLimits, now: float) -> None:
        self.limits = limits
        self.requests = (TokenBucket(limits.requests_per_minute, now)
                         if limits.requests_per_minute else None)
        self.tokens = TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None
        self.in_flight = 0

    def too_large(self, reserved_tokens: int) -> bool:
        """True when the reservation exceeds a whole minute's allowance: it would never be admitted."""
        return self.tokens is not None and reserved_tokens > self.tokens.capacity

    def admit(self, reserved_tokens: int, now: float) -> Admission:
        """Admit (taking from both buckets and a concurrency slot) or refuse (taking nothing)."""
        cap = self.limits.max_concurrent_requests
        if cap is not None and self.in_flight >= cap:
            return self._admission(False, now, "concurrency", 1.0)
        waits = {"requests": self.requests.wait_s(1, now) if self.requests else 0.0,
                 "tokens": self.tokens.wait_s(reserved_tokens, now) if self.tokens else 0.0}
        refused_by = max(waits, key=waits.__getitem__)
        if waits[refused_by] > 0:
            return self._admission(False, now, refused_by, waits[refused_by])
        if self.requests:
            self.requests.take(1, now)
        if self.tokens:
            self.tokens.take(reserved_tokens, now)
        self.in_flight += 1
        return self._admission(True, now)

    def finish(self, reserved_tokens: int, used_tokens: int, now: float) -> None:
        """An admitted request ended: free its slot, settle its tokens against the reservation."""
        self.in_flight -= 1
        if self.tokens is not None:
            self.tokens.give(reserved_tokens - used_tokens, now)  # negative: charged the excess

    def _admission(self, admitted: bool, now: float, refused_by: str | None = None,
                   retry_after_s: float = 0.0) -> Admission:
        return Admission(admitted, refused_by, retry_after_s,
                         self.requests.snapshot(now) if self.requests else None,
                         self.tokens.snapshot(now) if self.tokens else None)


def format_reset(seconds: float) -> str:
    """OpenAI's reset durations: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


def rate_limit_headers(admission: Admission) -> list[tuple[str, str]]:
    """OpenAI's headers for the limits this tenant has (none for a limit it does not have)."""
    headers = []
    for kind, snapshot in (("requests", admission.requests), ("tokens", admission.tokens)):
        if snapshot is not None:
            headers += [(f"x-ratelimit-limit-{kind}", str(snapshot.limit)),
                        (f"x-ratelimit-remaining-{kind}", str(snapshot.remaining)),
                        (f"x-ratelimit-reset-{kind}", format_reset(snapshot.reset_s))]
    return headers


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds: round up, at least 1."""
    return str(max(1, math.ceil(seconds)))
