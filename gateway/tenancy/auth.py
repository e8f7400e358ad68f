"""Reading the API key a request presents; `leases.Tenancy.authenticate` says whose it is."""

from __future__ import annotations

# Liveness, readiness and scraping stay open so orchestrators and Prometheus need no key.
# The chat page's files (gateway/web/chat_page.py) hold no secrets: served without a key, and
# the API calls the page makes carry the key its user types.
OPEN_HTTP_PATHS = frozenset({"/health", "/ready", "/metrics", "/", "/static/chat.js", "/static/chat.css"})


def bearer_token(authorization: str | None) -> str | None:
    """KEY from "Bearer KEY" (the scheme in any case); None for anything else."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def grpc_bearer_token(metadata) -> str | None:
    """The same from gRPC invocation metadata (keys are lower-case): `authorization: Bearer KEY`."""
    values = [value for key, value in (metadata or ()) if key == "authorization"]
    return bearer_token(values[0]) if values else None
