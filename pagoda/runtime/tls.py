"""Optional TLS on every gRPC hop: servers take --tls-cert/--tls-key, clients --tls-ca (all PEM).

Without them everything stays plaintext on 127.0.0.1 (the default bind address), as before.
"""

from __future__ import annotations

from pathlib import Path

import grpc


def add_port(server: grpc.aio.Server, address: str, cert: str | None = None,
             key: str | None = None) -> int:
    """Listen on `address`, with TLS when a cert and key are given; returns the bound port."""
    if cert is None and key is None:
        return server.add_insecure_port(address)
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    credentials = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
    return server.add_secure_port(address, credentials)


def aio_channel(target: str, ca: str | None = None, options=None) -> grpc.aio.Channel:
    """A channel to `target`, verifying its certificate against `ca` when given."""
    if ca is None:
        return grpc.aio.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes())
    return grpc.aio.secure_channel(target, credentials, options=options)
