"""gateway/upstream/dns_discovery.py, pure parts: the dns:// target syntax, the reconcile decision
(answer sets in, adds and drains out), and DnsDiscovery's failure and TTL handling with a scripted
resolver (no socket, no clock)."""

from __future__ import annotations

import dns.exception
import dns.resolver
import pytest

from gateway.config import GatewayConfig
from gateway.upstream.dns_discovery import (
    MIN_REFRESH_S,
    DnsDiscovery,
    DnsTarget,
    Reconcile,
    parse_dns_target,
    reconcile,
)


@pytest.mark.parametrize(("text", "want"), [
    ("dns:///pagoda-engine:50052", DnsTarget("pagoda-engine", 50052)),
    ("dns:///pagoda-engine.default.svc.cluster.local:50052",
     DnsTarget("pagoda-engine.default.svc.cluster.local", 50052)),
    ("dns://127.0.0.1:5353/pagoda-engine.test:50052", DnsTarget("pagoda-engine.test", 50052, "127.0.0.1", 5353)),
    ("dns://10.96.0.10/pagoda-engine:7000", DnsTarget("pagoda-engine", 7000, "10.96.0.10", 53)),
    ("dns://[::1]:5353/fleet.test:1", DnsTarget("fleet.test", 1, "::1", 5353)),
])
def test_targets_follow_grpcs_name_syntax(text, want):
    assert parse_dns_target(text) == want
    assert parse_dns_target(str(want)) == want  # round trip


@pytest.mark.parametrize("text", [
    "dns://", "dns:///", "dns:///name", "dns:///name:", "dns:///name:port", "dns:///:50052",
    "dns:///name:70000", "dns://127.0.0.1:x/name:1", "127.0.0.1:50052",
])
def test_malformed_targets_are_refused(text):
    with pytest.raises(ValueError):
        parse_dns_target(text)


def test_a_replica_is_dialled_at_the_resolved_address_with_the_names_port():
    target = parse_dns_target("dns://127.0.0.1:5353/pagoda-engine.test:50052")
    assert target.replica("127.0.0.2") == "127.0.0.2:50052"
    assert target.replica("fd00::2") == "[fd00::2]:50052"


# -- reconcile: the decision --------------------------------------------------------------------

def test_the_first_answer_adds_every_address():
    assert reconcile([], ["10.0.0.2:1", "10.0.0.1:1"]) == Reconcile(add=("10.0.0.1:1", "10.0.0.2:1"))


def test_the_same_answer_changes_nothing():
    change = reconcile(["a:1", "b:1"], ["b:1", "a:1"])
    assert change == Reconcile() and not change


def test_an_added_address_joins_and_a_missing_one_is_drained():
    assert reconcile(["a:1", "b:1"], ["b:1", "c:1"]) == Reconcile(add=("c:1",), drain=("a:1",))


def test_a_whole_new_answer_replaces_the_set():
    assert reconcile(["a:1", "b:1"], ["c:1"]) == Reconcile(add=("c:1",), drain=("a:1", "b:1"))


def test_an_empty_answer_never_empties_the_set():
    assert reconcile(["a:1", "b:1"], []) == Reconcile()


def test_an_address_that_left_and_comes_back_is_added_again():
    # `members` are the replicas in rotation: a drained one is not, so its address is an add.
    assert reconcile(["b:1"], ["a:1", "b:1"]) == Reconcile(add=("a:1",))


# -- DnsDiscovery with a scripted resolver ------------------------------------------------------

class Script:
    """Answers (or raises) in turn, one per lookup."""

    def __init__(self, *answers) -> None:
        self.answers, self.names = list(answers), []

    async def __call__(self, name: str):
        self.names.append(name)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _discovery(*answers, refresh_s: float = 5.0) -> DnsDiscovery:
    return DnsDiscovery(parse_dns_target("dns:///fleet.test:50052"), refresh_s, resolve=Script(*answers))


async def test_a_good_answer_gives_targets_and_waits_the_ttl_when_it_is_shorter():
    discovery = _discovery((frozenset({"10.0.0.1", "10.0.0.2"}), 2.0), (frozenset({"10.0.0.1"}), 30.0),
                           (frozenset({"10.0.0.1"}), 0.0))
    assert await discovery.resolve_once() == (frozenset({"10.0.0.1:50052", "10.0.0.2:50052"}), 2.0)
    assert await discovery.resolve_once() == (frozenset({"10.0.0.1:50052"}), 5.0)  # the refresh caps it
    assert await discovery.resolve_once() == (frozenset({"10.0.0.1:50052"}), MIN_REFRESH_S)  # TTL 0: a floor
    assert discovery._resolve.names == ["fleet.test"] * 3


async def test_failures_and_empty_answers_keep_the_last_good_set():
    discovery = _discovery((frozenset({"10.0.0.1"}), 5.0), dns.resolver.NXDOMAIN(), dns.exception.Timeout(),
                           (frozenset(), 5.0), OSError("network unreachable"), (frozenset({"10.0.0.3"}), 5.0))
    first, _ = await discovery.resolve_once()
    for _ in range(4):
        targets, wait_s = await discovery.resolve_once()
        assert targets is None and wait_s == 5.0  # nothing to apply: the set stays
        assert discovery.last_good == first
    assert discovery.failures == 4
    assert await discovery.resolve_once() == (frozenset({"10.0.0.3:50052"}), 5.0)
    assert discovery.failures == 0


async def test_before_any_good_answer_a_failure_is_retried_within_a_second():
    discovery = _discovery(dns.resolver.NoNameservers(), refresh_s=30.0)
    assert await discovery.resolve_once() == (None, 1.0)


def test_the_gateway_config_takes_a_dns_scheduler_alone_in_its_pool():
    config = GatewayConfig(scheduler="dns:///fleet.test:50052", scheduler_dns_refresh_s=2.0)
    assert config.scheduler_entries == ((None, "dns:///fleet.test:50052"),)
    GatewayConfig(scheduler="dns:///fleet.test:50052,big=10.0.0.9:50052")  # another pool beside it
    with pytest.raises(ValueError, match="only --scheduler"):
        GatewayConfig(scheduler="dns:///fleet.test:50052,10.0.0.9:50052")
    with pytest.raises(ValueError):
        GatewayConfig(scheduler="dns:///fleet.test")
    with pytest.raises(ValueError):
        GatewayConfig(scheduler="dns:///fleet.test:1", scheduler_dns_refresh_s=0)
