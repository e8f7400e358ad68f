"""DELETE /v1/sessions/{session_id}: end a session's lease now (docs/kv_tiers.md).

A request that names a `session_id` keeps its history's KV cached for the session's next turn
until its `session_ttl` passes; this ends it early, on every scheduler (a session's turns may go to
any replica or model pool). Sessions are the tenant's: the scheduler keys them by the request's
cache salt, which the API key's tenant prefixes, so a key reaches only its own tenant's sessions.
A session whose requests set their own `cache_salt` is ended with the same `?cache_salt=`.
"""

from __future__ import annotations

import asyncio

import grpc
from fastapi import FastAPI, Request

from gateway.errors import GatewayError
from gateway.openai.middleware import lease_of
from gateway.state import GatewayState
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)


class SessionNotFoundError(GatewayError):
    http_status, grpc_code = 404, grpc.StatusCode.NOT_FOUND


def add_session_routes(app: FastAPI, state: GatewayState) -> None:
    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request, cache_salt: str = "") -> dict:
        salt = lease_of(request.scope).tenant.prefix_cache_salt(cache_salt)
        found = await asyncio.gather(*(pool.client.end_session(session_id, salt) for pool in state.pools.pools),
                                     return_exceptions=True)
        if not any(f is True for f in found):
            raise SessionNotFoundError(f"no session {session_id!r} holds a lease (unknown, expired or ended)")
        log.info("session_deleted", session_id=session_id)
        return {"id": session_id, "object": "session", "deleted": True}
