"""Listening and connecting for every gRPC hop: exclusive ports, and optional TLS (servers take
--tls-cert/--tls-key, clients --tls-ca, all PEM; without them everything stays plaintext on
127.0.0.1, the default bind address).
"""

from __future__ import annotations

from pathlib import Path

import grpc

# gRPC servers bind with SO_REUSEPORT by default: a second (or stale) scheduler on the same port
# would silently take part of the traffic instead of failing. Every Pagoda server binds alone.
EXCLUSIVE_PORT = (("grpc.so_reuseport", 0),)

# The gateway's channel pings every 30 s (gateway/upstream/engine_client.py) to find a dead
# scheduler; a Generate stream is silent until its first token, which a long prompt on a CPU takes
# minutes to reach (Codex's 6k tokens, Claude Code's 21k). gRPC servers refuse pings more often
# than every 5 min without data: after a few they answer GOAWAY "too_many_pings" and the request
# dies (a 503 after exactly 240 s). Every Pagoda server accepts pings this often instead.
MIN_PING_INTERVAL_MS = 10_000
PERMIT_KEEPALIVE = (("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
                    ("grpc.keepalive_permit_without_calls", 1))


class AddressInUseError(OSError):
    """Another process listens on the address a server was asked to take."""


def new_server(options: list[tuple[str, object]] | None = None) -> grpc.aio.Server:
    """A grpc.aio server that will own its port exclusively (see EXCLUSIVE_PORT) and accept the
    clients' keepalive pings (PERMIT_KEEPALIVE; gRPC core spells the server's minimum interval
    between received pings `min_ping_interval_without_data_ms`)."""
    return grpc.aio.server(options=[*EXCLUSIVE_PORT, *PERMIT_KEEPALIVE, *(options or [])])


def add_port(server: grpc.aio.Server, address: str, cert: str | None = None,
             key: str | None = None) -> int:
    """Listen on `address`, with TLS when a cert and key are given; returns the bound port.
    Raises AddressInUseError, naming the address, when it cannot be bound."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    try:
        if cert is None:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
        return server.add_secure_port(address, credentials)
    except RuntimeError as error:  # grpc's "Failed to bind to address ..."
        raise AddressInUseError(f"address in use: cannot listen on {address} (is another Pagoda "
                                f"service running there?): {error}") from error


def aio_channel(target: str, ca: str | None = None, options=None) -> grpc.aio.Channel:
    """A channel to `target`, verifying its certificate against `ca` when given."""
    if ca is None:
        return grpc.aio.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes())
    return grpc.aio.secure_channel(target, credentials, options=options)
