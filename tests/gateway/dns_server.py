"""A tiny DNS server on loopback (dnslib) whose answer a test changes: the fleet's name for the
DNS-discovery tests (gateway/upstream/dns_discovery.py). UDP only, one name, A records only."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class FleetResolver(BaseResolver):
    """Answers `name` with `addresses` (TTL `ttl`); `rcode` set: that failure instead (SERVFAIL...).
    Every other name is NXDOMAIN. `queries` counts the questions about `name`."""

    def __init__(self, name: str, addresses: Iterable[str] = (), ttl: int = 1) -> None:
        self.name = name.rstrip(".")
        self.ttl = ttl
        self.rcode: int | None = None
        self.queries = 0
        self._addresses = tuple(addresses)
        self._lock = threading.Lock()  # the server thread reads what the test writes

    @property
    def addresses(self) -> tuple[str, ...]:
        with self._lock:
            return self._addresses

    def answer(self, addresses: Iterable[str]) -> None:
        with self._lock:
            self._addresses = tuple(addresses)

    def resolve(self, request, handler):
        reply = request.reply()
        qname = request.q.qname
        if str(qname).rstrip(".") != self.name:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        with self._lock:
            self.queries += 1
            addresses, rcode = self._addresses, self.rcode
        if rcode is not None:
            reply.header.rcode = rcode
        elif request.q.qtype == QTYPE.A:
            for address in addresses:
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(address), ttl=self.ttl))
        return reply


@contextmanager
def dns_server(resolver: FleetResolver, address: str = "127.0.0.1") -> Iterator[int]:
    """Serves `resolver` on a free UDP port of `address`; yields the port."""
    server = DNSServer(resolver, address=address, port=0, logger=DNSLogger(prefix=False, logf=lambda _: None))
    server.start_thread()
    try:
        yield server.server.server_address[1]
    finally:
        server.stop()
        server.server.server_close()
