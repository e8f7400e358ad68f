"""Which replica holds a session's KV: the gateway's session -> replica map (docs/kv_tiers.md).

A session's turns share their history, so prefix routing (routing.py) already sends them where that
history is cached. Two things move a session off its prefix owner: a restore (POST
/v1/sessions/{id}/restore loads its snapshot into one chosen replica) and load (the owner overloaded,
a failover). So the replica set records, per (cache salt, session id), the replica its last turn or
restore ran on, and routes the session's next turn there while that replica is in rotation.
Bounded: the least recently used sessions are forgotten first (they then route by prefix again).
"""

from __future__ import annotations

from collections import OrderedDict


class SessionHomes:
    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._homes: OrderedDict[tuple[str, str], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def get(self, cache_salt: str, session_id: str) -> int | None:
        return self._homes.get((cache_salt, session_id)) if session_id else None

    def set(self, cache_salt: str, session_id: str, replica: int) -> None:
        key = (cache_salt, session_id)
        self._homes[key] = replica
        self._homes.move_to_end(key)
        if len(self._homes) > self._capacity:
            self._homes.popitem(last=False)

    def drop(self, cache_salt: str, session_id: str) -> None:
        self._homes.pop((cache_salt, session_id), None)
