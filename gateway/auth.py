"""API-key checks shared by the HTTP middleware and the public gRPC servicer."""

from __future__ import annotations

import hmac

# Liveness, readiness and scraping stay open so orchestrators and Prometheus need no key.
OPEN_HTTP_PATHS = frozenset({"/health", "/ready", "/metrics"})


def bearer_token_ok(authorization: str | None, api_key: str | None) -> bool:
    """True when no key is configured, or `authorization` is exactly "Bearer <api_key>"."""
    if api_key is None:
        return True
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    # constant-time compare: the time taken does not reveal how much of the key matched
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def grpc_metadata_ok(metadata, api_key: str | None) -> bool:
    """The same check over gRPC invocation metadata (keys are lower-case)."""
    if api_key is None:
        return True
    values = [value for key, value in (metadata or ()) if key == "authorization"]
    return bool(values) and bearer_token_ok(values[0], api_key)
