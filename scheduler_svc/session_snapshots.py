"""Session save / restore on the scheduler (Engine.SaveSession / RestoreSession): the steps between
the servicer, the engine loop and the worker (docs/kv_tiers.md#session-save-and-restore).

Save: the core writes the lease's blocks in the next plan (core/tiers/snapshots.py); once that step
reported, the worker is asked the files' sizes (ReadSnapshot without verifying) for the answer.

Restore: the worker reads and verifies the snapshot first (ReadSnapshot: fingerprint and checksum of
every file; a corrupt or foreign one is refused here, before anything is scheduled), which gives
its tokens. Then a one-token request runs with those tokens as its prompt, the session id and TTL,
and a `kv_import` naming the snapshot: its admission loads the blocks its prefix hit lacks from the
files (core/tiers/migration.py), its last token is computed once, and when it finishes the session
lease takes its blocks as any turn's. Its sampled token is dropped.
"""

from __future__ import annotations

import os
import time
import uuid

from pagoda.contract.errors import RequestFailedError, SessionNotFoundError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.runtime.logging import get_logger
from pagoda.v1 import engine_pb2
from scheduler_svc.core.request import EngineRequest, KvHandoff
from scheduler_svc.core.tiers.snapshots import snapshot_name
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.worker_client import WorkerClient

log = get_logger(__name__)


class SessionSnapshots:
    def __init__(self, engine: EngineLoop, client: WorkerClient) -> None:
        self._engine, self._client = engine, client

    def _path(self, name: str) -> str:
        info = self._client.info
        return os.path.join(info.kv_snapshot_dir, name) if info is not None and info.kv_snapshot_dir else name

    async def save(self, cache_salt: str | None, session_id: str) -> engine_pb2.SessionSnapshot:
        name = snapshot_name(cache_salt, session_id)
        future = self._engine.save_session(cache_salt, session_id, name)
        if future is None:
            raise SessionNotFoundError(f"session {session_id!r} holds no lease here (unknown, expired or ended)")
        save = await future
        try:  # the files' sizes, and proof that the worker wrote them (a failed write is only logged there)
            listing = await self._client.read_snapshot(name, verify=False)
        except SessionNotFoundError:
            listing = None
        if listing is None or listing.num_blocks != save.num_blocks:
            raise RequestFailedError("the worker could not write the session snapshot (see its log: "
                                     "session_save_failed)")
        log.info("session_saved", session_id=session_id, snapshot=name, num_tokens=save.num_tokens,
                 num_blocks=save.num_blocks, num_bytes=listing.num_bytes)
        return engine_pb2.SessionSnapshot(session_id=session_id, num_tokens=save.num_tokens,
                                          num_blocks=save.num_blocks, num_bytes=listing.num_bytes,
                                          path=self._path(name))

    async def restore(self, cache_salt: str | None, session_id: str, ttl_s: float,
                      tenant: str = "") -> engine_pb2.SessionSnapshot:
        name = snapshot_name(cache_salt, session_id)
        listing = await self._client.read_snapshot(name)  # verified: refused files end it here
        tokens = tuple(listing.token_ids)
        request = EngineRequest(
            RequestId(f"restore-{uuid.uuid4().hex}"), tokens, SamplingParams(max_tokens=1, temperature=0.0),
            arrival_time=time.time(), cache_salt=cache_salt, session_id=session_id, session_ttl=ttl_s,
            tenant=tenant, kv_import=KvHandoff(name, len(tokens), listing.num_blocks, snapshot=True))
        stream = self._engine.add_request(request)
        cached = 0
        while True:
            update = await stream.queue.get()
            if isinstance(update, Exception):
                raise update
            cached = max(cached, *(d.num_cached_tokens for d in update.deltas), 0)
            if update.finished:
                break
        log.info("session_restored", session_id=session_id, snapshot=name, num_tokens=len(tokens),
                 num_blocks=listing.num_blocks, num_cached_tokens=cached)
        return engine_pb2.SessionSnapshot(session_id=session_id, num_tokens=len(tokens),
                                          num_blocks=listing.num_blocks, num_bytes=listing.num_bytes,
                                          path=self._path(name), num_cached_tokens=cached)
