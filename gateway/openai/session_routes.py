"""Sessions (docs/kv_tiers.md): DELETE /v1/sessions/{id}, POST /v1/sessions/{id}/save and /restore.

A request that names a `session_id` keeps its history's KV cached for the session's next turn
until its `session_ttl` passes; DELETE ends it early, on every scheduler (a session's turns may go
to any replica or model pool). Sessions are the tenant's: the scheduler keys them by the request's
cache salt, which the API key's tenant prefixes, so a key reaches only its own tenant's sessions.
A session whose requests set their own `cache_salt` is named with the same `?cache_salt=`.

Save / restore, as llama.cpp's `/slots/{id}?action=save|restore`: save writes the session's cached
history as a snapshot into the workers' --kv-snapshot-dir (the replica holding its lease does it);
restore loads that snapshot into one replica's prefix cache (body `model` picks the pool, `replica`
the replica, else the least loaded) and leases it again for `ttl` seconds, and the gateway routes
the session's next turns to that replica. So a session survives a restart, or moves between
replicas of one model. 404: no lease / no snapshot; 400: no snapshot folder; 409: a snapshot file
that is corrupt or another model's (refused, never served).
"""

from __future__ import annotations

import asyncio

import grpc
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import GatewayError, UpstreamError
from gateway.generation import DEFAULT_SESSION_TTL_S
from gateway.openai.middleware import lease_of
from gateway.state import GatewayState
from gateway.upstream.replica_set import ReplicaSet
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)


class SessionNotFoundError(GatewayError):
    http_status, grpc_code = 404, grpc.StatusCode.NOT_FOUND


class SnapshotRefusedError(GatewayError):
    http_status, grpc_code = 409, grpc.StatusCode.FAILED_PRECONDITION


class BadSessionRequestError(GatewayError):
    http_status, grpc_code = 400, grpc.StatusCode.INVALID_ARGUMENT


class SaveBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # the pool to look in; None: every pool


class RestoreBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # the pool to restore into; None: the default
    ttl: float = Field(default=DEFAULT_SESSION_TTL_S, gt=0)  # the restored lease's, seconds
    replica: int | None = Field(default=None, ge=0)  # within the pool; None: the least loaded


def _refusal(error: UpstreamError) -> GatewayError:
    """A snapshot the worker refused (checksum, fingerprint) is a conflict with this model: 409."""
    if error.grpc_code == grpc.StatusCode.FAILED_PRECONDITION:
        return SnapshotRefusedError(error.message)
    if error.grpc_code == grpc.StatusCode.NOT_FOUND:
        return SessionNotFoundError(error.message)
    return error


def _answer(session_id: str, pool_name: str, snapshot) -> dict:
    return {"id": session_id, "object": "session.snapshot", "model": pool_name, "tokens": snapshot.num_tokens,
            "blocks": snapshot.num_blocks, "bytes": snapshot.num_bytes, "path": snapshot.path}


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

    @app.post("/v1/sessions/{session_id}/save")
    async def save_session(session_id: str, request: Request, body: SaveBody | None = None,
                           cache_salt: str = "") -> dict:
        salt = lease_of(request.scope).tenant.prefix_cache_salt(cache_salt)
        pools = [state.pools.resolve(body.model)] if body is not None and body.model else state.pools.pools
        missing: UpstreamError | None = None
        for pool in pools:  # the pool whose scheduler holds its lease
            try:
                snapshot = await pool.client.save_session(session_id, salt)
            except UpstreamError as error:
                if error.grpc_code != grpc.StatusCode.NOT_FOUND:
                    raise _refusal(error) from None
                missing = error
                continue
            log.info("session_saved", session_id=session_id, model=pool.name, tokens=snapshot.num_tokens,
                     blocks=snapshot.num_blocks, bytes=snapshot.num_bytes)
            return _answer(session_id, pool.name, snapshot)
        raise SessionNotFoundError(f"no session {session_id!r} holds a lease to save (unknown, expired or "
                                   f"ended){': ' + missing.message if missing and len(pools) == 1 else ''}")

    @app.post("/v1/sessions/{session_id}/restore")
    async def restore_session(session_id: str, request: Request, body: RestoreBody | None = None,
                              cache_salt: str = "") -> dict:
        lease = lease_of(request.scope)
        salt = lease.tenant.prefix_cache_salt(cache_salt)
        body = body or RestoreBody()
        pool = state.pools.resolve(body.model)
        client = pool.client
        try:
            if isinstance(client, ReplicaSet):
                if body.replica is not None and body.replica >= len(client.replicas):
                    raise BadSessionRequestError(f"replica {body.replica} is out of range: the pool has "
                                       f"{len(client.replicas)}", param="replica")
                snapshot, replica = await client.restore_session(session_id, salt, body.ttl, lease.tenant.upstream_name,
                                                                 body.replica)
            else:
                snapshot, replica = await client.restore_session(session_id, salt, body.ttl, lease.tenant.upstream_name), 0
        except UpstreamError as error:
            raise _refusal(error) from None
        log.info("session_restored", session_id=session_id, model=pool.name, replica=replica,
                 tokens=snapshot.num_tokens, cached_tokens=snapshot.num_cached_tokens)
        return {**_answer(session_id, pool.name, snapshot), "cached_tokens": snapshot.num_cached_tokens,
                "replica": replica}
