"""The gateway's channel to the scheduler reconnects quickly after an outage."""

from __future__ import annotations

from gateway.upstream.engine_client import _CHANNEL_OPTIONS


def test_reconnect_backoff_is_capped_at_two_seconds():
    """gRPC's default backoff grows to 120 s: after a long scheduler outage the gateway would stay
    503 for up to two minutes after the scheduler is back."""
    options = dict(_CHANNEL_OPTIONS)
    assert options["grpc.max_reconnect_backoff_ms"] == 2000
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]


def test_every_server_accepts_the_gateways_keepalive_pings(monkeypatch):
    """A Generate stream is silent until its first token (minutes for an agent's long prompt on a
    CPU); gRPC servers by default take pings on a silent stream as abuse and close it with
    GOAWAY too_many_pings (Codex and Claude Code against Qwen2.5-Coder got a 503 after 240 s)."""
    from pagoda.runtime import tls

    server_options = dict(tls.PERMIT_KEEPALIVE)
    ping_ms = dict(_CHANNEL_OPTIONS)["grpc.keepalive_time_ms"]
    assert server_options["grpc.http2.min_ping_interval_without_data_ms"] < ping_ms
    captured = []
    monkeypatch.setattr(tls.grpc.aio, "server", lambda options: captured.append(dict(options)))
    tls.new_server([("grpc.max_receive_message_length", 1)])
    assert captured[0]["grpc.http2.min_ping_interval_without_data_ms"] == tls.MIN_PING_INTERVAL_MS
    assert captured[0]["grpc.max_receive_message_length"] == 1 and captured[0]["grpc.so_reuseport"] == 0


def test_the_keepalive_option_names_are_grpc_cores():
    """An option gRPC does not know is ignored silently: the first try of the fix above used the
    name of the C constant (..._MIN_RECV_PING_INTERVAL_...) and changed nothing."""
    import grpc._cython.cygrpc as cygrpc

    from pagoda.runtime import tls

    library = open(cygrpc.__file__, "rb").read()
    for name, _ in tls.PERMIT_KEEPALIVE + tuple(_CHANNEL_OPTIONS):
        assert name.encode() in library, name
