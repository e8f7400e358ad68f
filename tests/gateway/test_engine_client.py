"""The gateway's channel to the scheduler reconnects quickly after an outage."""

from __future__ import annotations

from gateway.upstream.engine_client import _CHANNEL_OPTIONS


def test_reconnect_backoff_is_capped_at_two_seconds():
    """gRPC's default backoff grows to 120 s: after a long scheduler outage the gateway would stay
    503 for up to two minutes after the scheduler is back."""
    options = dict(_CHANNEL_OPTIONS)
    assert options["grpc.max_reconnect_backoff_ms"] == 2000
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]
