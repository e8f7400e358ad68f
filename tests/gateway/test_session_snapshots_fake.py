"""POST /v1/sessions/{id}/save and /restore in the gateway, against in-process fake Engines: the
replica set saves on the session's replica first and routes a restored session's next turns to the
replica it was restored into (decision "session"); the routes answer in OpenAI's error shape: 404
for no lease / no snapshot, 400 for no snapshot folder, 409 for a refused (corrupt, foreign) snapshot."""

from __future__ import annotations

import grpc

from gateway import metrics
from gateway.errors import UpstreamError
from pagoda.v1 import engine_pb2
from tests.gateway.test_replica_set import _count, _engine, _request, replica_set


def _session_request(request_id: str, session_id: str = "chat") -> engine_pb2.GenerateRequest:
    request = _request(request_id)
    request.session_id, request.session_ttl_s = session_id, 60.0
    return request


async def _run(replicas, request) -> None:
    async for _ in replicas.generate(request):
        pass


async def test_save_asks_the_sessions_replica_and_a_restore_routes_its_next_turns():
    engines = [_engine(), _engine()]
    async with replica_set(*engines) as replicas:  # round-robin: the first request goes to replica 0
        await _run(replicas, _session_request("t1"))
        assert [len(e.requests) for e in engines] == [1, 0]
        saved = await replicas.save_session("chat", "")
        assert (saved.num_tokens, saved.num_blocks, saved.path) == (32, 2, "/snapshots/chat")
        assert [e.saved_sessions for e in engines] == [[("chat", "")], []]  # its home, and only there

        routed = _count(metrics.ROUTER_REQUESTS, "1", "session")
        restored, index = await replicas.restore_session("chat", "", 300.0, "tenant-a", replica=1)
        assert index == 1 and restored.num_cached_tokens == 16
        assert engines[1].restored_sessions == [("chat", "", 300.0, "tenant-a")]
        for rid in ("t2", "t3"):  # round-robin would alternate; the session stays on its replica
            await _run(replicas, _session_request(rid))
        assert [[r.request_id for r in e.requests] for e in engines] == [["t1"], ["t2", "t3"]]
        assert _count(metrics.ROUTER_REQUESTS, "1", "session") == routed + 2

        try:
            await replicas.save_session("nobody", "")
        except UpstreamError as error:
            assert error.grpc_code == grpc.StatusCode.NOT_FOUND
        else:
            raise AssertionError("an unknown session was saved")
        assert await replicas.end_session("chat", "")  # forgets its home too
        await _run(replicas, _session_request("t4"))
        assert replicas.sessions.get("", "chat") is not None  # ... until its next turn ran somewhere


async def test_the_routes_answer_in_openais_shape(gateway, upstream):
    http, engine = gateway.http, upstream.engine
    missing = await http.post("http://gateway/v1/sessions/chat/save")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"

    engine.snapshot_error = (grpc.StatusCode.INVALID_ARGUMENT, "no session snapshot folder: start the worker "
                             "with --kv-snapshot-dir")
    no_folder = await http.post("http://gateway/v1/sessions/chat/save")
    assert no_folder.status_code == 400 and "--kv-snapshot-dir" in no_folder.json()["error"]["message"]

    engine.snapshot_error = (grpc.StatusCode.FAILED_PRECONDITION, "session snapshot refused: checksum mismatch")
    refused = await http.post("http://gateway/v1/sessions/chat/restore", json={"ttl": 30})
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "ConflictError"
    engine.snapshot_error = (grpc.StatusCode.NOT_FOUND, "no session snapshot")
    assert (await http.post("http://gateway/v1/sessions/chat/restore")).status_code == 404

    engine.snapshot_error = None
    restored = await http.post("http://gateway/v1/sessions/chat/restore", json={"ttl": 30})
    assert restored.json() == {"id": "chat", "object": "session.snapshot", "model": restored.json()["model"],
                               "tokens": 32, "blocks": 2, "bytes": 4096, "path": "/snapshots/chat",
                               "cached_tokens": 16, "replica": 0}
    assert engine.restored_sessions[-1] == ("chat", "", 30.0, "")
    bad = await http.post("http://gateway/v1/sessions/chat/restore", json={"ttl": 0})
    assert bad.status_code == 400
