"""API-key checks and the command line."""

from __future__ import annotations

import pytest

from gateway.__main__ import parse_args
from gateway.auth import bearer_token_ok, grpc_metadata_ok


def test_bearer_token_checks():
    assert bearer_token_ok(None, None)
    assert bearer_token_ok("Bearer k1", "k1") and bearer_token_ok("bearer k1", "k1")
    assert not bearer_token_ok("Bearer k2", "k1")
    assert not bearer_token_ok("k1", "k1") and not bearer_token_ok(None, "k1")
    assert grpc_metadata_ok((("authorization", "Bearer k1"),), "k1")
    assert not grpc_metadata_ok((("x-other", "Bearer k1"),), "k1")


def test_parse_args_builds_the_config(monkeypatch):
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    config = parse_args(["--scheduler", "10.0.0.1:1", "--port", "9000", "--grpc-port", "9001",
                         "--tokenizer", "/m", "--served-model-name", "tiny", "--api-key", "k"])
    assert (config.scheduler, config.port, config.grpc_port, config.tokenizer) == ("10.0.0.1:1", 9000, 9001, "/m")
    assert (config.served_model_name, config.api_key) == ("tiny", "k")
    with pytest.raises(ValueError):
        parse_args(["--port", "70000"])
