"""Live migration seen from the gateway: the moves asked (POST /admin/migrate, drain) and what they took.

A move: the admin asks the replica streaming a request to export it (Engine.Migrate); that
replica's stream ends with FINISH_REASON_MIGRATED and a `kv_export` handoff; ReplicaSet.generate
then carries the stream on on the target replica as a failover continuation (prompt + the tokens
streamed) with `kv_import` = the handoff, so the target loads the KV instead of computing it. The
client's stream never sees the seam. `Moves` keeps, per request, the target asked for and the
instants (asked, exported, first token on the target) that the admin's answer reports.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pagoda.v1 import common_pb2, engine_pb2


def migrated_handoff(response: engine_pb2.GenerateResponse) -> common_pb2.KvHandoff | None:
    """The handoff of a response that ends its stream with MIGRATED, else None."""
    if any(d.finish_reason == common_pb2.FINISH_REASON_MIGRATED for d in response.sequences):
        return response.kv_export
    return None


@dataclass(slots=True)
class Move:
    target: int | None  # the replica asked for; None: the least loaded other one
    asked_at: float = field(default_factory=time.monotonic)
    source: int = -1
    exported_at: float | None = None
    handoff: common_pb2.KvHandoff | None = None
    chosen: int = -1
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def report(self) -> dict:
        now = time.monotonic()
        handoff = self.handoff or common_pb2.KvHandoff()
        return {"migrated": True, "source": self.source, "target": self.chosen,
                "num_kv_tokens": handoff.num_tokens, "num_kv_blocks": handoff.num_blocks,
                "export_seconds": round((self.exported_at or now) - self.asked_at, 6),
                "move_seconds": round(now - self.asked_at, 6)}


class Moves:
    def __init__(self) -> None:
        self._moves: dict[str, Move] = {}

    def start(self, request_id: str, target: int | None, source: int) -> Move:
        move = Move(target, source=source)
        self._moves[request_id] = move
        return move

    def exported(self, request_id: str, handoff: common_pb2.KvHandoff) -> Move | None:
        move = self._moves.get(request_id)
        if move is not None:
            move.exported_at, move.handoff = time.monotonic(), handoff
        return move

    def resumed(self, request_id: str) -> None:
        """The target streamed its first token: the move is complete."""
        move = self._moves.get(request_id)
        if move is not None and move.exported_at is not None:
            del self._moves[request_id]
            if not move.done.done():
                move.done.set_result(move.report())

    def ended(self, request_id: str) -> None:
        """The stream ended (finished first, failed, or the caller left): nothing moved, or the
        target finished without a token."""
        move = self._moves.pop(request_id, None)
        if move is not None and not move.done.done():
            move.done.set_result(move.report() if move.exported_at is not None else {"migrated": False})
