"""gateway/upstream/routing.py: prefix-aware routing, the other policies, the circuit breaker (no sleeps)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.upstream.routing import BreakerState, CircuitBreaker, Router, RoutingConfig, routing_key
from pagoda.contract import prefix_hash
from scheduler_svc.core import prefix_index

BLOCK = 16
NAMES = ["10.0.0.1:50052", "10.0.0.2:50052"]


def _router(policy="prefix", names=NAMES, **config) -> Router:
    return Router(names, RoutingConfig(policy=policy, **config))


def _prompt(system: int, user: int, length: int = 200) -> list[int]:
    """A shared 'system prompt' (96 tokens, 6 full blocks) chosen by `system`, then a user part."""
    rng = random.Random(system)
    head = [rng.randrange(50_000) for _ in range(96)]
    tail = random.Random(10_000 + user).choices(range(50_000), k=length - 96)
    return head + tail


def test_the_routing_key_is_the_schedulers_own_block_hash():
    tokens = _prompt(1, 1)
    for salt in (None, "tenant-a"):
        parent = None
        for i in range(4):  # what the scheduler's KV manager computes for the first 4 blocks
            parent = prefix_index.hash_block(parent, tokens[i * BLOCK:(i + 1) * BLOCK],
                                             prefix_index.block_extra_keys(i, salt))
        assert routing_key(tokens, salt or "", BLOCK, prefix_blocks=4) == parent
    assert prefix_index.hash_block is prefix_hash.hash_block  # one implementation, not two copies


def test_a_prompt_shorter_than_one_block_has_no_key_and_goes_to_the_least_loaded():
    assert routing_key(list(range(BLOCK - 1)), "", BLOCK, 4) is None
    router = _router()
    router.on_stats(0, num_waiting=3, num_running=2)
    assert router.choose(None, [0, 1]) == (1, "no_prefix")


def test_requests_sharing_a_system_prompt_go_to_one_replica():
    router = _router()
    for system in range(8):
        chosen = {router.choose(routing_key(_prompt(system, user), "", BLOCK, 4), [0, 1]).replica
                  for user in range(5)}
        router.on_stats(0, 0, 0), router.on_stats(1, 0, 0)  # fresh stats: nothing pending
        assert len(chosen) == 1, f"system prompt {system} went to {chosen}"


def test_prefixes_and_salts_spread_over_the_replicas():
    router = _router()
    by_prefix = Counter(router.owner(routing_key(_prompt(s, 0), "", BLOCK, 4), [0, 1]) for s in range(200))
    by_salt = Counter(router.owner(routing_key(_prompt(0, 0), f"tenant-{t}", BLOCK, 4), [0, 1])
                      for t in range(200))
    for counts in (by_prefix, by_salt):
        assert min(counts[0], counts[1]) > 60, counts  # ~100 each; far from all on one


def test_losing_a_replica_moves_only_its_keys():
    names = [f"r{i}:1" for i in range(4)]
    router = _router(names=names)
    keys = [routing_key(_prompt(s, 0), "", BLOCK, 4) for s in range(100)]
    before = {k: router.owner(k, [0, 1, 2, 3]) for k in keys}
    after = {k: router.owner(k, [0, 1, 3]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != 2)
    assert {after[k] for k in keys if before[k] == 2} <= {0, 1, 3}


def test_an_overloaded_owner_spills_to_the_least_loaded_replica():
    router = _router(overload_threshold=4)
    key = routing_key(_prompt(3, 0), "", BLOCK, 4)
    owner = router.owner(key, [0, 1])
    other = 1 - owner
    router.on_stats(owner, num_waiting=4, num_running=8)
    router.on_stats(other, num_waiting=0, num_running=8)
    assert router.choose(key, [0, 1]) == (owner, "prefix")  # queue 4 vs 0: within the threshold
    # now 5 (4 waiting + 1 routed since the stats) vs 0: over it
    assert router.choose(key, [0, 1]) == (other, "overloaded")
    router.on_stats(owner, num_waiting=0, num_running=8)  # its queue drained
    assert router.choose(key, [0, 1]) == (owner, "prefix")


def test_a_burst_between_two_stats_refreshes_spills_over_too():
    router = _router(overload_threshold=2)
    key = routing_key(_prompt(5, 0), "", BLOCK, 4)
    decisions = [router.choose(key, [0, 1]).reason for _ in range(8)]
    assert decisions[:3] == ["prefix"] * 3
    assert "overloaded" in decisions[3:]


def test_an_unavailable_owner_hands_its_keys_to_the_others():
    router = _router()
    key = routing_key(_prompt(1, 0), "", BLOCK, 4)
    owner = router.owner(key, [0, 1])
    assert router.choose(key, [1 - owner]).replica == 1 - owner


def test_round_robin_and_least_loaded():
    rr = _router("round-robin")
    assert [rr.choose(b"k", [0, 1]).replica for _ in range(4)] == [0, 1, 0, 1]
    ll = _router("least-loaded")
    ll.on_stats(0, num_waiting=2, num_running=4)
    ll.on_stats(1, num_waiting=0, num_running=1)
    assert ll.choose(b"k", [0, 1]) == (1, "least_loaded")


def test_the_default_policy_is_prefix_with_several_replicas():
    assert RoutingConfig().policy_for(2) == "prefix"
    with pytest.raises(ValueError, match="routing policy"):
        RoutingConfig(policy="random")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_n_consecutive_failures_only():
    clock = FakeClock()
    breaker = CircuitBreaker(failures=3, cooldown_s=5.0, clock=clock)
    assert not breaker.record_failure() and not breaker.record_failure()
    assert breaker.record_success() is False  # a success resets the count
    assert not breaker.record_failure() and not breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.record_failure() is True
    assert breaker.state is BreakerState.OPEN and not breaker.closed


def test_breaker_half_opens_after_the_cooldown_and_a_probe_decides():
    clock = FakeClock()
    breaker = CircuitBreaker(failures=1, cooldown_s=5.0, clock=clock)
    assert breaker.record_failure()
    clock.now += 4.9
    assert breaker.record_success() is False  # still cooling down: ignored
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.record_failure() is True  # the probe failed: open for another cool-down
    assert breaker.state is BreakerState.OPEN
    clock.now += 5.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.record_success() is True
    assert breaker.state is BreakerState.CLOSED and breaker.closed
