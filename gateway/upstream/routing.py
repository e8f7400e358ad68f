"""Routing a request to one of several scheduler replicas, and each replica's circuit breaker.

Pure: no grpc, no asyncio, no clock of its own (the breaker's is injected), so every decision is
unit-tested without sleeps. `gateway/upstream/replica_set.py` feeds it stats and failures and obeys it.

Policies:
- `prefix` (the default with more than one replica): the request's key is the chained hash of its
  first `prefix_blocks` full token blocks (pagoda/contract/prefix_hash.py: the very hash the
  scheduler caches those blocks under, salted with the request's cache_salt), and rendezvous
  hashing over the available replicas names its owner. Requests that share a prefix (a system
  prompt) therefore land where that prefix is cached; losing a replica moves only its keys. When
  the owner's queue exceeds the least-loaded replica's by more than `overload_threshold`, the
  request goes to the least-loaded one instead (a hot prefix must not pile up on one replica). A
  prompt shorter than one block has no key and goes to the least-loaded replica.
- `least-loaded`: the fewest waiting + running requests.
- `round-robin`: in turn.

Load is each scheduler's last GetStats (refreshed in the background, never per request) plus the
requests routed to it since that snapshot, so a burst between two refreshes still spreads.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pagoda.contract.prefix_hash import prefix_hash

POLICIES = ("prefix", "round-robin", "least-loaded")
# Why a request went where it went; the values of the metric's `decision` label.
DECISIONS = ("prefix", "overloaded", "no_prefix", "least_loaded", "round_robin", "session")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: str | None = None
    """prefix | round-robin | least-loaded; None: prefix with several replicas."""
    prefix_blocks: int = 4
    """Full token blocks of the prompt that make the routing key (4 × 16 = the first 64 tokens)."""
    overload_threshold: int = 4
    """Leave the prefix owner when its queue is longer than the least-loaded replica's by more."""
    stats_interval_s: float = 0.25
    """How often each replica's health and GetStats are refreshed (the load and the breaker probe)."""
    breaker_failures: int = 3
    """Consecutive failures (UNAVAILABLE, NOT_SERVING, no answer) that open a replica's breaker."""
    breaker_cooldown_s: float = 5.0
    """How long an open breaker keeps its replica out before a half-open probe."""
    max_stream_failovers: int = 2
    """Mid-stream failovers per request (a stream under way moved to another replica); 0: none."""

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.prefix_blocks < 1:
            raise ValueError("routing prefix_blocks must be at least 1")
        if self.overload_threshold < 0:
            raise ValueError("routing overload_threshold must not be negative")
        if self.stats_interval_s <= 0 or self.breaker_cooldown_s < 0:
            raise ValueError("stats_interval_s must be positive and breaker_cooldown_s not negative")
        if self.breaker_failures < 1:
            raise ValueError("breaker_failures must be at least 1")
        if self.max_stream_failovers < 0:
            raise ValueError("max_stream_failovers must not be negative")

    def policy_for(self, num_replicas: int) -> str:
        return self.policy or ("prefix" if num_replicas > 1 else "least-loaded")


class Decision(NamedTuple):
    replica: int
    reason: str  # one of DECISIONS


@dataclass(slots=True)
class ReplicaLoad:
    num_waiting: int = 0
    num_running: int = 0
    routed_since_stats: int = 0  # sent there after its last stats: not in them yet

    @property
    def queue(self) -> int:
        return self.num_waiting + self.routed_since_stats

    @property
    def total(self) -> int:
        return self.num_waiting + self.num_running + self.routed_since_stats


def routing_key(prompt_token_ids: Sequence[int], cache_salt: str, block_size: int,
                prefix_blocks: int, lora_key: str | None = None, mm_inputs: Sequence = ()) -> bytes | None:
    """The scheduler's hash of the prompt's `prefix_blocks`-th full block (or its last full one).
    `cache_salt` as on the wire: "" means none, as the scheduler reads it; `lora_key` the request's
    adapter (LoRARequest.cache_key), which keys the scheduler's cache too, as do the images."""
    return prefix_hash(prompt_token_ids, block_size, cache_salt or None, prefix_blocks, lora_key, mm_inputs)


def _score(key: bytes, name: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key + name, digest_size=8).digest(), "big")


class Router:
    """Picks a replica among the available ones; `names` are stable ids (the scheduler targets),
    so a key's owner does not change when the list is reordered or another replica comes or goes."""

    def __init__(self, names: Sequence[str], config: RoutingConfig) -> None:
        self.policy = config.policy_for(len(names))
        self.overload_threshold = config.overload_threshold
        self.loads = [ReplicaLoad() for _ in names]
        self._names = [name.encode() for name in names]
        self._turn = 0
        self._config = config

    def add(self, name: str) -> int:
        """A replica that joined (DNS discovery): the next index; the default policy becomes prefix
        once there are several."""
        self.loads.append(ReplicaLoad())
        self._names.append(name.encode())
        self.policy = self._config.policy_for(len(self._names))
        return len(self._names) - 1

    def on_stats(self, replica: int, num_waiting: int, num_running: int) -> None:
        self.loads[replica] = ReplicaLoad(num_waiting, num_running)

    def owner(self, key: bytes, candidates: Sequence[int]) -> int:
        """Rendezvous (highest random weight) hashing: the candidate scoring highest for the key."""
        return max(candidates, key=lambda i: _score(key, self._names[i]))

    def least_loaded(self, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda i: (self.loads[i].total, self.loads[i].queue, i))

    def choose(self, key: bytes | None, candidates: Sequence[int]) -> Decision:
        """The replica for a request with routing key `key`, among `candidates` (not empty)."""
        if not candidates:
            raise ValueError("no replica to choose from")
        if self.policy == "round-robin":
            decision = Decision(candidates[self._turn % len(candidates)], "round_robin")
            self._turn += 1
        elif self.policy == "least-loaded":
            decision = Decision(self.least_loaded(candidates), "least_loaded")
        elif key is None:
            decision = Decision(self.least_loaded(candidates), "no_prefix")
        else:
            owner, least = self.owner(key, candidates), self.least_loaded(candidates)
            if self.loads[owner].queue - self.loads[least].queue > self.overload_threshold:
                decision = Decision(least, "overloaded")
            else:
                decision = Decision(owner, "prefix")
        self.loads[decision.replica].routed_since_stats += 1
        return decision


class BreakerState(enum.Enum):
    CLOSED = "closed"  # in rotation
    OPEN = "open"  # out of rotation, cooling down
    HALF_OPEN = "half_open"  # cooled down: the next probe decides


class CircuitBreaker:
    """Opens after `failures` consecutive failures; after `cooldown_s` it is half-open: the next
    success closes it, the next failure opens it again for another cool-down. While open, results
    are ignored (a late answer from before it opened proves nothing)."""

    __slots__ = ("_clock", "_consecutive", "_cooldown_s", "_failures", "_opened_at", "_open")

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float]) -> None:
        self._failures, self._cooldown_s, self._clock = failures, cooldown_s, clock
        self._consecutive = 0
        self._open = False
        self._opened_at = 0.0

    @property
    def state(self) -> BreakerState:
        if not self._open:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self._cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    @property
    def closed(self) -> bool:
        return not self._open

    def record_failure(self) -> bool:
        """True when this failure opened the breaker (closed -> open, or half-open -> open)."""
        state = self.state
        if state is BreakerState.OPEN:
            return False
        self._consecutive += 1
        if state is BreakerState.HALF_OPEN or self._consecutive >= self._failures:
            self._open, self._opened_at = True, self._clock()
            return True
        return False

    def record_success(self) -> bool:
        """True when this success closed the breaker (half-open -> closed)."""
        state = self.state
        if state is BreakerState.OPEN:
            return False
        self._consecutive = 0
        if state is BreakerState.HALF_OPEN:
            self._open = False
            return True
        return False
