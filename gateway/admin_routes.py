"""Operator endpoints for live migration (docs/reliability.md#live-migration) and the replicas' state.

- `POST /admin/migrate {"request_id": ..., "target": replica index or null}`: move a stream under way
  to another replica of its pool with its KV (the target computes no prefill); answers once the
  target streamed its first token, with the move's figures. 404 when no replica streams that id.
- `POST /admin/drain {"replica": i}`: take replica i out of rotation and move every stream it
  serves elsewhere; then it can be stopped (or upgraded) with nothing lost. `{"replica": i,
  "undrain": true}` puts it back.
- `GET /admin/replicas`: every pool's replicas (index, target, state: serving / down / draining /
  removed, streams in flight, breaker); with `--scheduler dns://...`, the name's current addresses
  and the ones that left (docs/fleet.md).

The request id is the response's `id` (`cmpl-...`, `chatcmpl-...`). Behind the API key when
the gateway has one, as every non-public path.
"""

from __future__ import annotations

import grpc
from fastapi import FastAPI
from pydantic import BaseModel

from gateway.errors import GatewayError
from gateway.state import GatewayState
from gateway.upstream.replica_set import ReplicaSet
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)


class NotMigratableError(GatewayError):
    http_status, grpc_code = 404, grpc.StatusCode.NOT_FOUND


class MigrateBody(BaseModel):
    request_id: str
    target: int | None = None


class DrainBody(BaseModel):
    replica: int
    undrain: bool = False
    model: str | None = None  # the pool (default: the first)


def add_admin_routes(app: FastAPI, state: GatewayState) -> None:
    def replica_sets() -> list[ReplicaSet]:
        return [pool.client for pool in state.pools.pools if isinstance(pool.client, ReplicaSet)]

    @app.get("/admin/replicas")
    async def replicas() -> dict:
        pools = []
        for pool in state.pools.pools:
            client = pool.client
            entry = {"model": pool.name, "target": client.target}
            if isinstance(client, ReplicaSet):
                entry["replicas"] = client.describe()
            pools.append(entry)
        return {"pools": pools}

    @app.post("/admin/migrate")
    async def migrate(body: MigrateBody) -> dict:
        for replicas in replica_sets():
            if body.target is not None and not 0 <= body.target < len(replicas.replicas):
                continue
            try:
                moved = await replicas.migrate(body.request_id, body.target)
            except TimeoutError:  # asked, but the target has not streamed yet: it may still move
                return {"request_id": body.request_id, "migrated": False, "error": "timed out"}
            if moved is not None:
                log.info("request_migrated", request_id=body.request_id, **moved)
                return {"request_id": body.request_id, **moved}
        raise NotMigratableError(f"no replica is streaming request {body.request_id!r} (or no such target)")

    @app.post("/admin/drain")
    async def drain(body: DrainBody) -> dict:
        pool = state.pools.resolve(body.model) if body.model else state.pools.default
        replicas = pool.client
        if not isinstance(replicas, ReplicaSet) or not 0 <= body.replica < len(replicas.replicas):
            raise NotMigratableError(f"no replica {body.replica} in pool {pool.name!r}")
        if body.undrain:
            replicas.undrain(body.replica)
            return {"replica": body.replica, "drained": False}
        moved = await replicas.drain(body.replica)
        log.info("replica_drained", replica=body.replica, num_moved=sum(m.get("migrated", False) for m in moved))
        return {"replica": body.replica, "drained": True, "moves": moved}
