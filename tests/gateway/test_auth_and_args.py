"""API-key checks and the command line."""

from __future__ import annotations

import pytest

from gateway.__main__ import parse_args
from gateway.tenancy.auth import bearer_token, grpc_bearer_token
from gateway.tenancy.leases import Tenancy
from gateway.tenancy.tenants import ANONYMOUS, tenant_table


def test_bearer_token_checks():
    assert bearer_token("Bearer k1") == bearer_token("bearer k1") == "k1"
    assert bearer_token("k1") is None and bearer_token(None) is None and bearer_token("Bearer ") is None
    assert grpc_bearer_token((("authorization", "Bearer k1"),)) == "k1"
    assert grpc_bearer_token((("x-other", "Bearer k1"),)) is None


def test_single_api_key_is_the_default_tenant():
    tenancy = Tenancy(tenant_table("k1", None))
    assert tenancy.authenticate("k1").name == "default"
    assert tenancy.authenticate("k2") is None and tenancy.authenticate(None) is None
    assert Tenancy(tenant_table(None, None)).authenticate(None) is ANONYMOUS  # no key: auth off


def test_parse_args_builds_the_config(monkeypatch):
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    config = parse_args(["--scheduler", "10.0.0.1:1", "--port", "9000", "--grpc-port", "9001",
                         "--tokenizer", "/m", "--served-model-name", "tiny", "--api-key", "k"])
    assert (config.scheduler, config.port, config.grpc_port, config.tokenizer) == ("10.0.0.1:1", 9000, 9001, "/m")
    assert (config.served_model_name, config.api_key) == ("tiny", "k")
    with pytest.raises(ValueError):
        parse_args(["--port", "70000"])


def test_several_schedulers_and_the_routing_flags(monkeypatch):
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    config = parse_args(["--scheduler", "10.0.0.1:1", "--scheduler", "10.0.0.2:1,10.0.0.3:1",
                         "--routing-policy", "round-robin", "--routing-overload-threshold", "7",
                         "--breaker-failures", "2", "--breaker-cooldown", "0.5"])
    assert config.schedulers == ("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")
    assert (config.routing.policy, config.routing.overload_threshold) == ("round-robin", 7)
    assert (config.routing.breaker_failures, config.routing.breaker_cooldown_s) == (2, 0.5)
    assert parse_args([]).schedulers == ("127.0.0.1:50052",)
    with pytest.raises(ValueError, match="breaker_failures"):
        parse_args(["--breaker-failures", "0"])
