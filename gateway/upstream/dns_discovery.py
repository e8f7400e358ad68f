"""A replica set that finds itself: `--scheduler dns:///NAME:PORT` keeps the set equal to NAME's A records.

Targets use gRPC's name syntax: `dns:///NAME:PORT` asks the system's resolver (/etc/resolv.conf:
in Kubernetes, a headless Service's name gives one A record per ready pod), and
`dns://SERVER[:SERVERPORT]/NAME:PORT` asks that DNS server (a test server on 127.0.0.1:5353).
Every address in the answer is a replica dialled at `ADDRESS:PORT`.

`reconcile` is the pure decision (answer in, adds and drains out); `DnsDiscovery` resolves with
dnspython every `--scheduler-dns-refresh-s` (sooner when the answer's TTL is shorter) and hands the
decision to the ReplicaSet, which owns the replicas (gateway/upstream/replica_set.py): a replica that
left the answer is drained (no new request goes to it, those under way finish there) and then
closed; a new address joins the routing at once. A failed or empty answer never empties the set:
the last good one stays, and the failure is logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
SCHEME = "dns://"
DEFAULT_REFRESH_S = 5.0
# The TTL shortens the refresh (the answer is stale after it), never below this: a TTL of 0 must
# not turn into a resolver hammered in a loop.
MIN_REFRESH_S = 0.5


def is_dns_target(target: str) -> bool:
    return target.startswith(SCHEME)


@dataclass(frozen=True, slots=True)
class DnsTarget:
    name: str  # the DNS name whose A records are the replicas
    port: int  # every replica's scheduler port
    server: str | None = None  # the DNS server to ask; None: the system's resolver
    server_port: int = 53

    def __str__(self) -> str:
        authority = "" if self.server is None else _join(self.server, self.server_port)
        return f"{SCHEME}{authority}/{self.name}:{self.port}"

    def replica(self, address: str) -> str:
        """The scheduler target of one resolved address (the name's port)."""
        return _join(address, self.port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split(text: str, what: str, default_port: int | None = None) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon:
        host, port = text, ""
    host = host.removeprefix("[").removesuffix("]")
    if not port:
        if default_port is None:
            raise ValueError(f"a dns:// scheduler needs the {what}'s port, got {text!r}")
        return host, default_port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a dns:// scheduler's {what} is HOST:PORT, got {text!r}")
    return host, int(port)


def parse_dns_target(target: str) -> DnsTarget:
    """`dns:///NAME:PORT` or `dns://SERVER[:PORT]/NAME:PORT` (gRPC's syntax) -> DnsTarget."""
    if not is_dns_target(target):
        raise ValueError(f"not a dns:// target: {target!r}")
    authority, slash, rest = target[len(SCHEME):].partition("/")
    if not slash or not rest:
        raise ValueError(f"a dns:// scheduler is dns:///NAME:PORT or dns://SERVER:PORT/NAME:PORT, got {target!r}")
    name, port = _split(rest, "name")
    if authority:
        server, server_port = _split(authority, "DNS server", default_port=53)
        return DnsTarget(name, port, server, server_port)
    return DnsTarget(name, port)


@dataclass(frozen=True, slots=True)
class Reconcile:
    """What an answer changes: targets that join the set (new, or back after leaving) and targets
    in the set that left the answer (to drain). Both empty: nothing to do."""

    add: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.add or self.drain)


def reconcile(members: Iterable[str], answer: Iterable[str]) -> Reconcile:
    """The set `members` (targets in rotation, drains excluded) made equal to `answer`. An empty
    answer changes nothing: a name that resolves to no address is a fault, and draining every
    replica would fail every request."""
    members, answer = set(members), set(answer)
    if not answer:
        return Reconcile()
    return Reconcile(add=tuple(sorted(answer - members)), drain=tuple(sorted(members - answer)))


class DnsDiscovery:
    """Resolves `target` periodically and calls `apply(targets)` with each good answer (a frozenset
    of HOST:PORT, never empty). `resolve` may be replaced (tests): name -> (addresses, ttl_s)."""

    def __init__(self, target: DnsTarget, refresh_s: float = DEFAULT_REFRESH_S, timeout_s: float = 2.0,
                 resolve: Callable | None = None) -> None:
        if refresh_s <= 0:
            raise ValueError(f"the DNS refresh interval must be positive, got {refresh_s}")
        self.target, self.refresh_s, self._timeout_s = target, refresh_s, timeout_s
        self._resolve = resolve or self._resolve_a
        self._resolver: dns.asyncresolver.Resolver | None = None
        self.last_good: frozenset[str] = frozenset()
        self.last_resolved_at: float | None = None  # monotonic instant of the last good answer
        self.failures = 0  # consecutive

    def _system_or_given_resolver(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:  # built on first use: reading /etc/resolv.conf may fail (logged)
            if self.target.server is None:
                self._resolver = dns.asyncresolver.Resolver()
            else:
                self._resolver = dns.asyncresolver.Resolver(configure=False)
                self._resolver.nameservers = [self.target.server]
                self._resolver.port = self.target.server_port
            self._resolver.lifetime = self._timeout_s
        return self._resolver

    async def _resolve_a(self, name: str) -> tuple[frozenset[str], float]:
        # The system's resolver searches its domains as libc does (a Service's short name in a pod).
        answer = await self._system_or_given_resolver().resolve(name, "A", search=self.target.server is None)
        return frozenset(record.address for record in answer), float(answer.rrset.ttl)

    async def resolve_once(self) -> tuple[frozenset[str] | None, float]:
        """One lookup: (the replicas' targets, seconds until the next) — None when it failed or was
        empty (the set stays as it was; logged)."""
        try:
            addresses, ttl_s = await self._resolve(self.target.name)
        except (dns.exception.DNSException, OSError) as error:
            return self._failed(f"{type(error).__name__}: {error}")
        if not addresses:
            return self._failed("the answer has no address")
        targets = frozenset(self.target.replica(a) for a in addresses)
        if self.failures:
            log.info("scheduler_dns_recovered", target=str(self.target), after_failures=self.failures)
        self.failures = 0
        if targets != self.last_good:
            log.info("scheduler_dns_resolved", target=str(self.target), replicas=sorted(targets), ttl_s=ttl_s)
        self.last_good, self.last_resolved_at = targets, time.monotonic()
        return targets, min(self.refresh_s, max(ttl_s, MIN_REFRESH_S))

    def _failed(self, why: str) -> tuple[None, float]:
        self.failures += 1
        log.warning("scheduler_dns_failed", target=str(self.target), error=why, failures=self.failures,
                    keeping=sorted(self.last_good))
        # Before the first good answer the gateway has no replica at all: retry sooner.
        return None, self.refresh_s if self.last_good else min(self.refresh_s, 1.0)

    async def run(self, apply: Callable[[frozenset[str]], None]) -> None:
        """Forever (cancel to stop): resolve, apply a good answer, wait."""
        while True:
            targets, wait_s = await self.resolve_once()
            if targets is not None:
                try:
                    apply(targets)
                except Exception as error:  # noqa: BLE001 - a bug must not stop the discovery for good
                    log.error("scheduler_dns_apply_failed", target=str(self.target), error=repr(error))
            await asyncio.sleep(wait_s)
